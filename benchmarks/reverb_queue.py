"""Reverb side of the queue benchmark (see benchmarks/queue_tables.py).

Run with the Reverb virtualenv:

    .venv-reverb/bin/python benchmarks/reverb_queue.py [--rows N] [--seconds S]

A Reverb server with one ``reverb.Table.queue(max_size=QUEUE_MAX)`` (FIFO
selector and remover, Reverb's ``Queue`` rate limiter: inserts block when
full, samples when empty) runs in a child process (this file with
``--serve``). In this process an actor thread inserts small rows (17
float32) one item per step with the legacy writer (its fastest insert path
here, benchmarks/REVERB_NOTES.md), while the main thread consumes them with
``TrajectoryDataset`` in batches of 256 (its fastest sample path). Prints one
JSON line: rows consumed per second, from the first insert to the last row taken.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import queue_workload as Q  # noqa: E402
import reverb_service as R  # noqa: E402



def serve() -> None:
    """Child process: a Reverb server with the queue table until stdin closes."""
    import reverb
    import tensorflow as tf

    # The legacy writer stores one-step sequences: each item is [1, 17].
    signature = {key: tf.TensorSpec((1, *shape), tf.as_dtype(dtype), name=key)
                 for key, (shape, dtype) in Q.ROW_SPEC.items()}
    table = reverb.Table.queue(R.TABLE, max_size=Q.QUEUE_MAX, signature=signature)
    server = reverb.Server(tables=[table], port=None)
    try:
        sys.stdout.write(f"PORT {server.port}\n")
        sys.stdout.flush()
        os.dup2(2, 1)
        sys.stdin.buffer.read()
    finally:
        server.stop()


def measure(rows: int, seconds: float) -> dict:
    import reverb
    import tensorflow as tf

    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    watchdog = threading.Timer(seconds + 300, proc.kill)
    watchdog.start()
    try:
        word, port = proc.stdout.readline().decode().split()
        assert word == "PORT"
        address = f"{R.HOST}:{port}"
        client = reverb.Client(address)
        steps = [{"obs": row} for row in Q.make_rows(rows)]
        dataset = reverb.TrajectoryDataset.from_table_signature(
            address, R.TABLE, max_in_flight_samples_per_worker=2 * Q.BATCH,
            num_workers_per_iterator=R.SAMPLE_WORKERS, rate_limiter_timeout_ms=5_000,
        ).batch(Q.BATCH)
        deadline = time.perf_counter() + seconds
        start = time.perf_counter()
        actor = threading.Thread(target=lambda: R.write_rows_legacy(client, steps, deadline))
        actor.start()
        taken = 0
        try:
            for sample in dataset:
                taken += int(tf.shape(sample.data["obs"])[0])
                if taken >= rows or time.perf_counter() > deadline:
                    break
        except tf.errors.DeadlineExceededError:
            pass  # the actor stopped at the deadline and the queue ran dry
        finally:
            elapsed = time.perf_counter() - start
            actor.join(timeout=seconds + 60)  # it stops at the deadline; then the server may stop
        return {"side": "reverb", "api": "writer per step + TrajectoryDataset (batch 256)",
                "rows": taken, "rows_per_s": taken / elapsed}
    finally:
        watchdog.cancel()
        proc.stdin.close()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=int, default=Q.ROWS)
    parser.add_argument("--seconds", type=float, default=Q.SECONDS)
    args = parser.parse_args()
    if args.serve:
        serve()
        return
    print(json.dumps(measure(args.rows, args.seconds)), flush=True)


if __name__ == "__main__":
    main()
