"""An acknowledged change survives ``kill -9`` (``[server] wal = true``, docs/durability.md).

A real server process is killed with SIGKILL at random moments while writer
threads (each with its own client) insert rows and update the priorities of
their own rows, insert into a queue (``fifo``) table, and publish variables,
while taker threads take from the queue under leases and acknowledge (by
their next sample, or ``ack``), and timed checkpoints truncate the log in
between. After each restart: every row whose insert was acknowledged is
present, bit for bit, under the id it was given; no id was ever issued
twice; every insert is there whole or not at all; each priority is the last
one acknowledged (or the one an unanswered update was sending when the
server died); each variable is at the version (and bytes) last
acknowledged, or at a later one an unanswered publish was sending; the
queue hands out no row whose take was acknowledged, and every row inserted
whose take was never acknowledged (taken under a lease, or never taken),
bit for bit (then the check acknowledges them all).

``make test`` runs a handful of kills (``test_wal_crash_loop``); ``make soak``
(``-m slow``) at least 50 (``test_wal_crash_loop_long``).
"""

from __future__ import annotations

import math
import random
import signal
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from replay_client import ReplayClient
from replay_client.errors import ReplayError
from tests.conftest import start_server

ROWS_PER_INSERT = (1, 8)
PRIORITIES = [k / 8 for k in range(1, 64)]  # 1/8 apart: far more than the stored rounding


@dataclass
class Ledger:
    """What the writers were told (shared by the threads of one test)."""

    rows: dict[int, bytes] = field(default_factory=dict)  # id -> the row's bytes
    priorities: dict[int, set[float]] = field(default_factory=dict)  # id -> allowed values
    issued: list[int] = field(default_factory=list)
    variables: dict[str, tuple[int, bytes]] = field(default_factory=dict)  # last acknowledged
    unanswered: dict[str, list[bytes]] = field(default_factory=dict)  # publishes since
    queue: dict[int, bytes] = field(default_factory=dict)  # queue rows inserted: id -> bytes
    queue_issued: list[int] = field(default_factory=list)  # (ids are per table)
    taken: set[int] = field(default_factory=set)  # queue rows whose take was acknowledged
    unsure: set[int] = field(default_factory=set)  # ... whose acknowledgement went unanswered
    lock: threading.Lock = field(default_factory=threading.Lock)


def _config(tmp_path) -> str:
    return f"""
[server]
checkpoint_dir = "{tmp_path / 'ckpt'}"
checkpoint_interval_s = 0.3
wal = true
wal_sync = "os"

[[tables]]
name = "replay"
capacity = 1_000_000
sampler = "prioritized"

[[tables]]
name = "queue"
capacity = 1_000_000
sampler = "fifo"
lease_timeout_s = 600
"""


def _writer(address: str, writer: int, ledger: Ledger, stop: threading.Event,
            rng: random.Random, base: int) -> None:
    """Insert and update until ``stop`` (at most 10,000 calls); ``base`` numbers the calls."""
    client = ReplayClient(address, timeout=5, max_retry_s=0.5)
    own: list[int] = []
    try:
        for call in range(base, base + 10_000):
            if stop.is_set():
                break
            if rng.random() < 0.1:
                _publish(client, writer, ledger, rng)
            elif rng.random() < 0.2:
                _insert_queue(client, writer, call, ledger, rng)
            elif own and rng.random() < 0.3:
                _update(client, own, ledger, rng)
            else:
                _insert(client, writer, call, own, ledger, rng)
    finally:
        client.close()


def _insert(client: ReplayClient, writer: int, call: int, own: list[int], ledger: Ledger,
            rng: random.Random) -> None:
    k = rng.randint(*ROWS_PER_INSERT)
    head = np.array([[writer, call, i, k] for i in range(k)], dtype=np.float32)
    blob = np.frombuffer(rng.randbytes(64 * k), dtype=np.uint8).reshape(k, 64).copy()
    explicit = rng.random() < 0.5
    priorities = np.array([rng.choice(PRIORITIES) for _ in range(k)]) if explicit else None
    try:
        ids = client.insert("replay", {"head": head, "blob": blob}, priorities=priorities)
    except ReplayError:
        time.sleep(0.01)  # the server is gone: may or may not be stored, never half
        return
    ids = ids.tolist()
    with ledger.lock:
        ledger.issued.extend(ids)
        for i, row_id in enumerate(ids):
            ledger.rows[row_id] = head[i].tobytes() + blob[i].tobytes()
            if explicit:
                assert priorities is not None
                ledger.priorities[row_id] = {float(priorities[i])}
    own.extend(ids)


def _update(client: ReplayClient, own: list[int], ledger: Ledger, rng: random.Random) -> None:
    chosen = list(dict.fromkeys(rng.sample(own, min(len(own), rng.randint(1, 6)))))
    values = [rng.choice(PRIORITIES) for _ in chosen]
    try:
        client.update_priorities("replay", np.array(chosen, dtype=np.int64), np.array(values))
    except ReplayError:  # unanswered: the old value (if known) or this one
        with ledger.lock:
            for row_id, value in zip(chosen, values):
                if row_id in ledger.priorities:
                    ledger.priorities[row_id].add(value)
        time.sleep(0.01)
        return
    with ledger.lock:
        for row_id, value in zip(chosen, values):
            ledger.priorities[row_id] = {value}


def _insert_queue(client: ReplayClient, writer: int, call: int, ledger: Ledger,
                  rng: random.Random) -> None:
    k = rng.randint(*ROWS_PER_INSERT)
    head = np.array([[writer, call, i, k] for i in range(k)], dtype=np.float32)
    blob = np.frombuffer(rng.randbytes(16 * k), dtype=np.uint8).reshape(k, 16).copy()
    try:
        ids = client.insert("queue", {"head": head, "blob": blob})
    except ReplayError:
        time.sleep(0.01)
        return
    with ledger.lock:
        ledger.queue_issued.extend(ids.tolist())
        for i, row_id in enumerate(ids.tolist()):
            ledger.queue[row_id] = head[i].tobytes() + blob[i].tobytes()


def _taker(address: str, ledger: Ledger, stop: threading.Event, rng: random.Random) -> None:
    """Take from the queue under leases and acknowledge until ``stop`` (at most 10,000 calls).
    A sample acknowledges the client's earlier leases; what was taken and never acknowledged
    when the server died must come back."""
    client = ReplayClient(address, timeout=5, max_retry_s=0.5)
    held: list[int] = []  # taken, acknowledgement not sent yet
    try:
        for _ in range(10_000):
            if stop.is_set():
                break
            try:
                if held and rng.random() < 0.3:
                    client.ack("queue")
                    batch = []
                else:
                    batch = client.sample("queue", rng.randint(1, 4), wait=False).ids.tolist()
            except ReplayError:  # empty, or the server is gone: acknowledged or not
                with ledger.lock:
                    ledger.unsure.update(held)
                held = []
                time.sleep(0.01)
                continue
            with ledger.lock:
                ledger.taken.update(held)
            held = batch
    finally:
        client.close()


def _check_queue(client: ReplayClient, ledger: Ledger) -> None:
    """No acknowledged take comes back; every other row inserted does, bit for bit. Then every
    row handed out is acknowledged (by the check)."""
    got: dict[int, bytes] = {}
    for _ in range(100_000):
        size = client.info()["queue"].size
        if size == 0:
            break
        batch = client.sample("queue", min(size, 256), wait=False)
        head, blob = batch.data["head"].numpy(), batch.data["blob"].numpy()
        for k, row_id in enumerate(batch.ids.tolist()):
            assert row_id not in got, ("a row handed out twice", row_id)
            got[row_id] = head[k].tobytes() + blob[k].tobytes()
    client.ack("queue")
    again = ledger.taken & got.keys()
    assert not again, ("acknowledged takes handed out again", sorted(again)[:10])
    missing = ledger.queue.keys() - ledger.taken - ledger.unsure - got.keys()
    assert not missing, ("rows never acknowledged that did not come back", sorted(missing)[:10])
    for row_id, data in got.items():
        assert ledger.queue.get(row_id, data) == data, row_id
    ledger.taken.update(got)
    ledger.unsure.difference_update(got)


def _publish(client: ReplayClient, writer: int, ledger: Ledger, rng: random.Random) -> None:
    name = f"policy-{writer}"
    weights = np.frombuffer(rng.randbytes(4 * 32), dtype=np.float32).copy()
    try:
        version = client.publish(name, {"w": torch.from_numpy(weights)})
    except ReplayError:  # unanswered: published (a later version) or not
        with ledger.lock:
            ledger.unanswered.setdefault(name, []).append(weights.tobytes())
        time.sleep(0.01)
        return
    with ledger.lock:
        ledger.variables[name] = (version, weights.tobytes())
        ledger.unanswered.pop(name, None)


def _check_variables(client: ReplayClient, ledger: Ledger) -> None:
    """Each variable at its last acknowledged version and bytes, or a later unanswered one."""
    for name, (version, data) in ledger.variables.items():
        got = client.fetch(name)
        got_bytes = got["w"].numpy().tobytes()
        if (got.version, got_bytes) != (version, data):
            assert got.version > version and got_bytes in ledger.unanswered.get(name, []), (
                name, got.version, version)


def _check(address: str, ledger: Ledger) -> int:
    """Every acknowledged row and priority as the ledger says; every insert whole. Returns rows."""
    client = ReplayClient(address, timeout=30)
    try:
        assert len(set(ledger.issued)) == len(ledger.issued), "an id was issued twice"
        assert len(set(ledger.queue_issued)) == len(ledger.queue_issued), "a queue id twice"
        ids = sorted(ledger.rows)
        if ids:
            read = client.read("replay", ids=np.array(ids, dtype=np.int64), priorities=True)
            assert read.ids.tolist() == ids
            head = read.columns["head"].numpy()
            blob = read.columns["blob"].numpy()
            for k, row_id in enumerate(ids):
                assert head[k].tobytes() + blob[k].tobytes() == ledger.rows[row_id], row_id
                allowed = ledger.priorities.get(row_id)
                if allowed is not None:
                    got = float(read.priorities[k])  # stored as p**alpha: read back within 1e-9
                    assert any(math.isclose(got, p, rel_tol=1e-6) for p in allowed), (
                        row_id, got, allowed)
        _check_variables(client, ledger)
        _check_queue(client, ledger)
        size = client.info()["replay"].size
        if size:  # every insert present is whole: k rows of one call, i = 0..k-1
            everything = client.read("replay", positions=np.arange(size)).columns["head"].numpy()
            calls: dict[tuple[int, int], set[int]] = {}
            for writer, call, i, k in everything.astype(np.int64).tolist():
                calls.setdefault((writer, call), set()).add(i)
                assert i < k
            for (writer, call), seen in calls.items():
                k = int(everything[(everything[:, 0] == writer) & (everything[:, 1] == call)][0, 3])
                assert seen == set(range(k)), ("half an insert", writer, call, seen, k)
        return size
    finally:
        client.close()


def crash_loop(tmp_path, kills: int, writers: int, seed: int, budget_s: float) -> None:
    rng = random.Random(seed)
    ledger = Ledger()
    config = _config(tmp_path)
    deadline = time.monotonic() + budget_s
    server = start_server(tmp_path, config)
    done = 0
    try:
        # The first three kills are made whatever the time (each round is bounded by its
        # timeouts); the budget bounds only the rest, so a loaded machine is never a failure.
        while done < kills and (done < min(kills, 3) or time.monotonic() < deadline):
            stop = threading.Event()
            threads = [threading.Thread(target=_writer, args=(
                server.address, w, ledger, stop, random.Random(rng.random()), done * 10_000))
                for w in range(writers)]
            threads += [threading.Thread(target=_taker, args=(
                server.address, ledger, stop, random.Random(rng.random()))) for _ in range(2)]
            for thread in threads:
                thread.start()
            time.sleep(rng.uniform(0.2, 1.2))
            server.process.send_signal(signal.SIGKILL)
            server.process.wait(timeout=30)
            done += 1
            stop.set()
            for thread in threads:
                thread.join(timeout=60)
                assert not thread.is_alive(), "a writer did not stop"
            server = start_server(tmp_path, config, name=f"server{done}")
            rows = _check(server.address, ledger)
            assert rows >= len(ledger.rows)
        assert len(ledger.rows) > 0, "no insert was acknowledged"
        assert ledger.taken, "no take was acknowledged"
        logs = "".join((tmp_path / f"server{n}.log").read_text() for n in range(1, done + 1))
        assert "replayed the write-ahead log" in logs  # not only checkpoints brought rows back
    finally:
        server.stop(signal.SIGKILL)


def test_wal_crash_loop(tmp_path) -> None:
    """A handful of kill -9s over about 20-30 s: nothing acknowledged is lost."""
    crash_loop(tmp_path, kills=6, writers=3, seed=29, budget_s=40)


@pytest.mark.slow
def test_wal_crash_loop_long(tmp_path) -> None:
    """make soak: at least 50 kill -9s."""
    crash_loop(tmp_path, kills=50, writers=4, seed=2929, budget_s=1800)
