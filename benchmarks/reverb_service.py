"""Reverb side of the service benchmark (see benchmarks/service_workload.py).

Run with the Reverb virtualenv (benchmarks/envs/reverb.sh):

    .venv-reverb/bin/python benchmarks/reverb_service.py --kind atari|small \
        --case insert|sample|update [--seconds S] [--api NAME]

A Reverb server runs in a child process (this same file with ``--serve``);
the benchmark client runs in this process and talks to it over loopback
(127.0.0.1). One JSON line per measurement goes to stdout, logs to stderr.
(Reverb's Python Server has no bind-address option: its gRPC listener is
``[::]:PORT``; all traffic here still goes to 127.0.0.1 only.)
The child is stopped at the end, on error, and by a watchdog if a measurement
overruns ``--seconds`` plus its setup budget.

The table is the one the brief fixes: Prioritized(ALPHA) sampler, Fifo
remover, max_size=CAPACITY[kind], MinSize(1) rate limiter, and a signature
matching ``row_spec(kind)`` (one squeezed step per item), so that
``TrajectoryDataset.from_table_signature`` works and items are validated.

APIs (``--api``; the default is the fastest measured on the 2-core box, see
benchmarks/REVERB_NOTES.md):

* insert: ``trajectory_writer`` (``client.trajectory_writer(1)``: append +
  create_item(history[k][-1]) + ``flush(block_until_num_items=TW_WINDOW)``
  per row) or ``writer`` (legacy ``client.writer(1, max_in_flight_items=
  LEGACY_IN_FLIGHT)``: append + create_item(num_timesteps=1) per row; it
  pipelines up to ``max_in_flight_items`` by itself).
* sample: ``trajectory_dataset`` (``reverb.TrajectoryDataset
  .from_table_signature(...).batch(SAMPLE_BATCH)`` iterated eagerly, tensors
  turned into numpy) or ``client.sample`` (``client.sample(table,
  num_samples=SAMPLE_BATCH, emit_timesteps=False)`` + ``np.stack`` per column).
* update: ``client.mutate_priorities`` with ``--ids-per-call`` keys per call (the
  ``{key: priority}`` dict is built from numpy arrays inside the timed loop).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import numpy as np  # noqa: E402

import service_workload as W  # noqa: E402

TABLE = "replay"
HOST = "127.0.0.1"
PREFILL = {"atari": 20_000, "small": 200_000}
TW_WINDOW = 40            # trajectory_writer: items left pending by the per-row flush
                          # (Reverb warns "alarmingly high" from ~50 pending items)
LEGACY_IN_FLIGHT = 1_000  # legacy writer: max_in_flight_items
SAMPLE_IN_FLIGHT = 2 * W.SAMPLE_BATCH  # TrajectoryDataset max_in_flight_samples_per_worker
SAMPLE_WORKERS = 4        # TrajectoryDataset num_workers_per_iterator (auto, -1, was
                          # up to 1.8x slower for small rows on the 2-core box)
GEN_CHUNK = 1_000         # rows per make_rows call when pre-generating
KEYS_WANTED = 8 * W.UPDATE_BATCH
SETUP_BUDGET_S = 600.0    # watchdog: --seconds + this, then everything is killed

DEFAULT_API = {"insert": "writer", "sample": "trajectory_dataset",
               "update": "client.mutate_priorities"}
APIS = {"insert": ("trajectory_writer", "writer"),
        "sample": ("trajectory_dataset", "client.sample"),
        "update": ("client.mutate_priorities",)}


def log(msg: str) -> None:
    print(f"[reverb_service] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------- server

def make_table(kind: str):
    import reverb
    import tensorflow as tf

    signature = {key: tf.TensorSpec(shape, tf.as_dtype(dtype), name=key)
                 for key, (shape, dtype) in W.row_spec(kind).items()}
    return reverb.Table(
        name=TABLE,
        sampler=reverb.selectors.Prioritized(W.ALPHA),
        remover=reverb.selectors.Fifo(),
        max_size=W.CAPACITY[kind],
        rate_limiter=reverb.rate_limiters.MinSize(1),
        signature=signature,
    )


def serve(kind: str) -> None:
    """Child process: run the server until stdin closes (parent done or dead)."""
    import tempfile

    import reverb

    # Reverb's default checkpointer leaves a temp dir behind; use one we remove.
    with tempfile.TemporaryDirectory(prefix="reverb-bench-ckpt-") as ckpt:
        server = reverb.Server(tables=[make_table(kind)], port=None,
                               checkpointer=reverb.checkpointers.DefaultCheckpointer(ckpt))
        try:
            sys.stdout.write(f"PORT {server.port}\n")
            sys.stdout.flush()
            os.dup2(2, 1)          # anything printed later goes to stderr
            sys.stdin.buffer.read()
        finally:
            server.stop()


class ServerProcess:
    """The Reverb server in a child process; stopped on exit, whatever happens."""

    def __init__(self, kind: str, start_timeout_s: float = 180.0):
        self.kind = kind
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None

    def __enter__(self) -> "ServerProcess":
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--serve", "--kind", self.kind],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None,
        )
        try:
            deadline = time.monotonic() + self.start_timeout_s
            line = b""
            while not line.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("Reverb server did not report its port in time")
                ready, _, _ = select.select([self.proc.stdout], [], [], left)
                if ready:
                    ch = os.read(self.proc.stdout.fileno(), 1)
                    if not ch:
                        raise RuntimeError(f"Reverb server exited early (rc={self.proc.poll()})")
                    line += ch
            word, port = line.decode().split()
            assert word == "PORT", line
            self.port = int(port)
        except BaseException:
            self.stop()
            raise
        log(f"server pid {self.proc.pid} on port {self.port}")
        return self

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        try:
            proc.stdin.close()          # the child stops its server and exits
        except OSError:
            pass
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def kill_now(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---------------------------------------------------------------------- rows

def pregenerate(kind: str, n: int, first_row: int = 0) -> list[dict[str, np.ndarray]]:
    """n per-row dicts (views into column chunks made by make_rows)."""
    rows: list[dict[str, np.ndarray]] = []
    for start in range(first_row, first_row + n, GEN_CHUNK):
        m = min(GEN_CHUNK, first_row + n - start)
        cols = W.make_rows(kind, start, m)
        for i in range(m):
            # 0-d arrays for scalar keys (a numpy array, not a numpy scalar).
            rows.append({k: v[i] if v.ndim > 1 else v[i:i + 1].reshape(()) for k, v in cols.items()})
    return rows


def write_rows_trajectory(client, rows, deadline: float | None) -> int:
    """trajectory_writer path; returns the number of rows confirmed by the server."""
    keys = list(rows[0].keys())
    writer = client.trajectory_writer(num_keep_alive_refs=1)
    done = 0
    try:
        for row in rows:
            writer.append(row)
            hist = writer.history
            writer.create_item(TABLE, 1.0, {k: hist[k][-1] for k in keys})
            done += 1
            # Acme's adder pattern (flush after each item, leaving a window of
            # items in flight), with a wider window: see REVERB_NOTES.md.
            writer.flush(block_until_num_items=TW_WINDOW)
            if deadline is not None and done % 64 == 0 and time.perf_counter() >= deadline:
                break
        writer.flush()
    finally:
        writer.close()
    return done


def write_rows_legacy(client, rows, deadline: float | None) -> int:
    """Legacy client.writer path (one-step sequences, one item each)."""
    writer = client.writer(max_sequence_length=1, max_in_flight_items=LEGACY_IN_FLIGHT)
    done = 0
    try:
        for row in rows:
            writer.append(row)
            writer.create_item(TABLE, 1, 1.0)
            done += 1
            if deadline is not None and done % 64 == 0 and time.perf_counter() >= deadline:
                break
        writer.flush()
    finally:
        writer.close()
    return done


WRITERS = {"trajectory_writer": write_rows_trajectory, "writer": write_rows_legacy}


def table_size(client) -> int:
    return int(client.server_info()[TABLE].current_size)


def prefill(client, kind: str) -> int:
    n = min(W.CAPACITY[kind], PREFILL[kind])
    t0 = time.perf_counter()
    done = 0
    while done < n:                     # in chunks, to bound client memory
        m = min(20_000, n - done)
        done += write_rows_trajectory(client, pregenerate(kind, m, first_row=done), None)
    log(f"prefilled {done} rows in {time.perf_counter() - t0:.1f} s; table size {table_size(client)}")
    return done


# ---------------------------------------------------------------- measurements

def bench_insert(client, kind: str, seconds: float, api: str) -> dict:
    n = W.INSERT_ROWS[kind]
    t0 = time.perf_counter()
    rows = pregenerate(kind, n)
    log(f"pre-generated {n} rows in {time.perf_counter() - t0:.1f} s")
    if api not in WRITERS:
        raise ValueError(api)
    # As on our side (service.py): measured on a warm table, after a first pass of the
    # same rows and a reset.
    WRITERS[api](client, rows, None)
    client.reset(TABLE)
    start = time.perf_counter()
    deadline = start + seconds
    done = WRITERS[api](client, rows, deadline)
    elapsed = time.perf_counter() - start
    size = table_size(client)
    if size != done:
        log(f"WARNING: table holds {size} rows after inserting {done}")
    rate = done / elapsed
    return {"rows_per_s": rate, "mb_per_s": rate * W.row_bytes(kind) / 1e6,
            "rows": done, "seconds": elapsed}


def _dataset_batches(address: str):
    import reverb

    ds = reverb.TrajectoryDataset.from_table_signature(
        server_address=address, table=TABLE,
        max_in_flight_samples_per_worker=SAMPLE_IN_FLIGHT,
        num_workers_per_iterator=SAMPLE_WORKERS,
        rate_limiter_timeout_ms=10_000,
        get_signature_timeout_secs=30,
    ).batch(W.SAMPLE_BATCH, drop_remainder=True)
    for sample in ds:
        yield (sample.info.key.numpy(),
               {k: v.numpy() for k, v in sample.data.items()})


def _client_sample_batches(client, keys: list[str]):
    while True:
        samples = list(client.sample(TABLE, num_samples=W.SAMPLE_BATCH, emit_timesteps=False))
        ids = np.fromiter((s.info.key for s in samples), dtype=np.uint64, count=len(samples))
        # Without unpack_as_table_signature the data is flat, in signature order
        # (tree.flatten sorts dict keys).
        cols = list(zip(*(s.data for s in samples)))
        yield ids, {k: np.stack(c) for k, c in zip(sorted(keys), cols)}


def bench_sample(client, address: str, kind: str, seconds: float, api: str) -> dict:
    prefill(client, kind)
    keys = list(W.row_spec(kind))
    if api == "trajectory_dataset":
        batches = _dataset_batches(address)
    elif api == "client.sample":
        batches = _client_sample_batches(client, keys)
    else:
        raise ValueError(api)
    for _ in range(3):                  # warm-up: connection, first requests
        next(batches)
    nbatches = 0
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        ids, data = next(batches)
        assert len(ids) == W.SAMPLE_BATCH and data[keys[0]].shape[0] == W.SAMPLE_BATCH
        nbatches += 1
        if time.perf_counter() >= deadline:
            break
    elapsed = time.perf_counter() - start
    batches.close()
    rate = nbatches * W.SAMPLE_BATCH / elapsed
    return {"rows_per_s": rate, "mb_per_s": rate * W.row_bytes(kind) / 1e6,
            "batches": nbatches, "batch": W.SAMPLE_BATCH, "seconds": elapsed}


def bench_update(client, address: str, kind: str, seconds: float, api: str,
                 per_call: int = W.UPDATE_BATCH) -> dict:
    if api != "client.mutate_priorities":
        raise ValueError(api)
    n = prefill(client, kind)
    wanted = min(KEYS_WANTED, n // 2)
    found: set[int] = set()
    batches = _dataset_batches(address)
    t0 = time.perf_counter()
    while len(found) < wanted and time.perf_counter() - t0 < 120:
        ids, _ = next(batches)
        found.update(int(k) for k in ids)
    batches.close()
    keys = sorted(found)
    log(f"collected {len(keys)} item keys in {time.perf_counter() - t0:.1f} s")
    if len(keys) < per_call:
        raise RuntimeError(f"only {len(keys)} keys collected")
    # The learner holds ids (uint64, from the sample info) and new priorities
    # (float64) as arrays; Reverb's API takes a {key: priority} dict, so the
    # dict is built inside the timed loop (the cheapest way: .tolist() + zip).
    key_arr = np.asarray(keys, dtype=np.uint64)
    windows = [(key_arr[j * per_call:(j + 1) * per_call],
                W.new_priorities(per_call, seed=j))
               for j in range(len(keys) // per_call)]

    def update(i: int) -> None:
        ids, prios = windows[i % len(windows)]
        client.mutate_priorities(TABLE, updates=dict(zip(ids.tolist(), prios.tolist())))

    for i in range(2):                  # warm-up
        update(i)
    calls = 0
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        update(calls)
        calls += 1
        if time.perf_counter() >= deadline:
            break
    elapsed = time.perf_counter() - start
    rate = calls * per_call / elapsed
    return {"ids_per_s": rate, "calls": calls, "batch": per_call, "seconds": elapsed}


# ----------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=W.ROW_KINDS, required=True)
    ap.add_argument("--case", choices=("insert", "sample", "update"))
    ap.add_argument("--seconds", type=float, default=W.SECONDS)
    ap.add_argument("--api", default=None,
                    help="insert: trajectory_writer|writer; sample: trajectory_dataset|client.sample")
    ap.add_argument("--ids-per-call", type=int, default=W.UPDATE_BATCH,
                    help="update: keys per mutate_priorities call")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.serve:
        serve(args.kind)
        return 0
    if args.case is None:
        ap.error("--case is required")
    api = args.api or DEFAULT_API[args.case]
    if api not in APIS[args.case]:
        ap.error(f"--api for {args.case} must be one of {APIS[args.case]}")

    server = ServerProcess(args.kind)

    def watchdog() -> None:
        log(f"watchdog: no result after {args.seconds + SETUP_BUDGET_S:.0f} s, stopping")
        try:
            server.stop()               # closes its stdin; terminate/kill if it hangs
        finally:
            server.kill_now()
            os._exit(3)

    timer = threading.Timer(args.seconds + SETUP_BUDGET_S, watchdog)
    timer.daemon = True
    timer.start()
    try:
        with server:
            import reverb

            client = reverb.Client(server.address)
            if args.case == "insert":
                res = bench_insert(client, args.kind, args.seconds, api)
            elif args.case == "sample":
                res = bench_sample(client, server.address, args.kind, args.seconds, api)
            else:
                res = bench_update(client, server.address, args.kind, args.seconds, api,
                                   args.ids_per_call)
            del client
    finally:
        timer.cancel()
    out = {"impl": "reverb", "kind": args.kind, "case": args.case, **res, "api": api,
           "reverb_version": _version("dm-reverb")}
    print(json.dumps(out), flush=True)
    return 0


def _version(dist: str) -> str:
    try:
        from importlib.metadata import version
        return version(dist)
    except Exception:  # pragma: no cover
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
