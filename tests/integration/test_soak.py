"""Soak: 4 actor processes and a learner against one server with a rate limiter.

Actors insert 32-row batches as fast as the limiter lets them; the learner
samples batches of 64 and updates their priorities. The server's resident
memory is sampled every second: from the end of the warm-up (at least
``warm_up_s`` and the table wrapped) to the end it may grow by at most 5%. Every
side must finish with zero errors, and the server's log must hold no error.

``make test`` runs 15 seconds (5 of them warm-up) from the moment every actor has started, on a
table of 5,000 rows (so that it wraps within the warm-up on a loaded machine); ``make soak``
(``-m slow``) runs ``REPLAY_SOAK_S`` seconds (default 1800) on 10,000 rows. Run with ``-s`` to
see the figures.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import time
from dataclasses import dataclass, field

import psutil
import pytest
import torch

from replay_client import ReplayClient, errors

ACTORS = 4
ROWS_PER_INSERT = 32
BATCH_SIZE = 64
CAPACITY = 10_000
SAMPLES_PER_INSERT = 2.0
MIN_SIZE = 1_000
ERROR_BUFFER = 1_000.0
CALL_TIMEOUT_S = 60
MAX_GROWTH = 0.05
START_TIMEOUT_S = 180  # for the actor processes to start (imports take long on a loaded machine)

BOUNDED_CAPACITY = 5_000
CONFIG = """
[server]
workers = 4

[[tables]]
name = "replay"
capacity = {capacity}
sampler = "prioritized"
min_size_to_sample = {min_size}
samples_per_insert = {samples_per_insert}
error_buffer = {error_buffer}
[tables.schema]
obs = "float32[16]"
action = "int64[]"
reward = "float32[]"
done = "bool[]"
"""


def _actor(client: ReplayClient, number: int, duration_s: float, started, results) -> None:
    rows = calls = 0
    errors: list[str] = []
    generator = torch.Generator().manual_seed(number)
    try:
        started.wait(timeout=START_TIMEOUT_S)  # every actor imported and ready: the clock runs
        stop_at = time.time() + duration_s
        while time.time() < stop_at:
            client.insert("replay", {
                "obs": torch.randn(ROWS_PER_INSERT, 16, generator=generator),
                "action": torch.randint(4, (ROWS_PER_INSERT,), generator=generator),
                "reward": torch.randn(ROWS_PER_INSERT, generator=generator),
                "done": torch.rand(ROWS_PER_INSERT, generator=generator) < 0.01,
            })
            rows += ROWS_PER_INSERT
            calls += 1
    except BaseException as exc:  # reported to the test
        errors.append(repr(exc))
    results.put({"actor": number, "rows": rows, "calls": calls, "errors": errors})


@dataclass
class Learner:
    client: ReplayClient
    batches: int = 0
    updates: int = 0
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                batch = self.client.sample("replay", BATCH_SIZE)
            except errors.DeadlineExceededError:
                if self.stop.is_set():
                    return  # held back after the actors stopped: the run is over
                raise
            except BaseException as exc:
                self.errors.append(repr(exc))
                return
            self.batches += 1
            td_errors = batch.data["reward"].abs() + 0.01
            try:
                self.updates += self.client.update_priorities("replay", batch.ids, td_errors)
            except BaseException as exc:
                self.errors.append(repr(exc))
                return


def test_soak_bounded(server_factory) -> None:
    soak(server_factory, duration_s=15, warm_up_s=5, capacity=BOUNDED_CAPACITY)


@pytest.mark.slow
def test_soak_at_length(server_factory) -> None:
    duration = float(os.environ.get("REPLAY_SOAK_S", 1800))
    soak(server_factory, duration_s=duration, warm_up_s=min(120.0, duration / 3))


def soak(server_factory, duration_s: float, warm_up_s: float, capacity: int = CAPACITY) -> None:
    server = server_factory(CONFIG.format(capacity=capacity, min_size=MIN_SIZE,
                                          samples_per_insert=SAMPLES_PER_INSERT,
                                          error_buffer=ERROR_BUFFER))
    process = psutil.Process(server.process.pid)
    client = ReplayClient(server.address, timeout=CALL_TIMEOUT_S)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    # The soak's clock starts once every actor has started (spawned processes import torch:
    # tens of seconds on a loaded machine, which would otherwise eat the warm-up).
    started = context.Barrier(ACTORS + 1)
    actors = [context.Process(target=_actor, args=(client, n, duration_s, started, results))
              for n in range(ACTORS)]
    for actor in actors:
        actor.start()
    started.wait(timeout=START_TIMEOUT_S)
    start = time.time()
    learner = Learner(ReplayClient(server.address, timeout=CALL_TIMEOUT_S))
    learner_thread = threading.Thread(target=learner.run)
    learner_thread.start()

    rss: list[tuple[float, int]] = []  # (seconds since start, bytes), once a second
    warm: tuple[float, int, int] | None = None  # (seconds, rss, rows inserted) at warm-up end
    try:
        for second in range(int(duration_s) + 1):
            time.sleep(max(0.0, start + second - time.time()))
            rss.append((time.time() - start, process.memory_info().rss))
            if warm is None and second >= warm_up_s:
                # Warm once the table has wrapped (actor processes take a while to start
                # on a loaded machine): memory is measured from there on.
                inserted = client.info()["replay"].counters["inserted"]
                if inserted >= capacity:
                    warm = (rss[-1][0], rss[-1][1], inserted)
            if server.process.poll() is not None or learner.errors:
                break
        reports = [results.get(timeout=CALL_TIMEOUT_S + 30) for _ in actors]
    finally:
        # Only once the actors are done (a held-back insert needs samples); a sample the
        # learner has in flight may be held back now, so insert until it returns.
        learner.stop.set()
        extra_rows = 0
        for _ in range(30):
            learner_thread.join(timeout=1)
            if not learner_thread.is_alive() or server.process.poll() is not None:
                break
            client.insert("replay", {"obs": torch.zeros(ROWS_PER_INSERT, 16),
                                     "action": torch.zeros(ROWS_PER_INSERT, dtype=torch.int64),
                                     "reward": torch.zeros(ROWS_PER_INSERT),
                                     "done": torch.zeros(ROWS_PER_INSERT, dtype=torch.bool)})
            extra_rows += ROWS_PER_INSERT
        for actor in actors:
            actor.join(timeout=30)
            if actor.is_alive():
                actor.kill()
    info = client.info()["replay"]
    end_rss = process.memory_info().rss
    figures = {
        "duration_s": round(time.time() - start, 1),
        "rss_warm_up_mib": round(warm[1] / 2**20, 1) if warm else None,
        "rss_end_mib": round(end_rss / 2**20, 1),
        "rss_max_after_warm_up_mib": round(max(r for t, r in rss if warm and t >= warm[0])
                                           / 2**20, 1) if warm else None,
        "rows_inserted": info.counters["inserted"],
        "rows_inserted_by_warm_up": warm[2] if warm else None,
        "batches_sampled": learner.batches,
        "priority_updates": learner.updates,
        "limiter": {k: info.rate_limiter[k] for k in ("inserts", "samples", "deletes")},
    }
    print("\nsoak figures:", json.dumps(figures))

    assert server.process.poll() is None, server.log()[-3000:]
    assert [r["errors"] for r in reports] == [[]] * ACTORS, reports
    assert learner.errors == [], learner.errors
    assert not learner_thread.is_alive()
    assert sum(r["rows"] for r in reports) + extra_rows == info.counters["inserted"]
    assert learner.updates == learner.batches * BATCH_SIZE - info.counters["stale_priority_updates"]
    assert warm is not None and warm[2] >= capacity, f"the table had not wrapped: {figures}"
    assert end_rss <= warm[1] * (1 + MAX_GROWTH), f"server memory grew: {figures}"
    log = server.log()
    assert " ERROR " not in log and "Traceback" not in log, log[-3000:]
    # The limiter held the ratio: the count stayed within one call of its window.
    count = info.rate_limiter["inserts"] * SAMPLES_PER_INSERT - info.rate_limiter["samples"]
    assert count <= info.rate_limiter["max_diff"] + (ROWS_PER_INSERT - 1) * SAMPLES_PER_INSERT
    assert count >= info.rate_limiter["min_diff"] - (BATCH_SIZE - 1)
