"""Service benchmark: replay-server against Reverb, each server in its own process.

    python benchmarks/service.py --reverb-python .venv-reverb/bin/python

(or ``make bench-service``, which also builds Reverb's virtualenv). For each
row kind (Atari frames, 17 floats) and operation (insert, prioritized sample
of 256, priority updates; publish and fetch of a policy, ours alone), it starts the server in a separate process, drives
it from this one client process over 127.0.0.1, stops it, and moves on; then
the same for Reverb (``benchmarks/reverb_service.py`` in its own virtualenv).
Prints rows/s (or ids/s), MB/s and the ratio ours / Reverb.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import service_workload as w  # noqa: E402
from sides import replay_server, run_side  # noqa: E402


_CONFIG = "[server]\nworkers = 2\n" + "".join(
    f'[[tables]]\nname = "{kind}"\ncapacity = {w.CAPACITY[kind]}\n'
    f'sampler = "prioritized"\nalpha = {w.ALPHA}\nbeta = {w.BETA}\n'
    for kind in w.ROW_KINDS
)


def _rows_as_torch(rows):
    import torch

    return {key: torch.from_numpy(value) for key, value in rows.items()}


def _ours(kind: str, case: str, seconds: float, per_call: int = w.UPDATE_BATCH,
          config: str = _CONFIG) -> list[dict]:
    import torch

    from replay_client import ReplayClient

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        with replay_server(Path(tmp), config) as address:
            client = ReplayClient(address, timeout=120)
            mb = w.row_bytes(kind) / 1e6
            out = []
            if case == "publish":
                return _variables(client, kind, seconds)
            if case == "insert":
                n = w.INSERT_ROWS[kind]
                rows = _rows_as_torch(w.make_rows(kind, 0, n))
                steps = [{k: v[i] for k, v in rows.items()} for i in range(n)]
                chunk = 256 if kind == "atari" else 8192  # Atari: 7 MB, in gRPC's fast range
                # Both ways are measured on a warm table, as a long-running server's is: a
                # first pass of the same rows (then a reset) has the server touch the
                # table's pages and the connection start. (Measured first on a fresh
                # table, the Writer alone paid that: its server spent 57-86 us of CPU a
                # row against 34-39 us warm, 2026-11-28.) Reverb's side does the same.
                for first in range(0, n, chunk):
                    client.insert(kind, {k: v[first:first + chunk] for k, v in rows.items()})
                client.reset(kind)
                start = time.perf_counter()
                done = 0
                with client.writer(kind, batch_rows=256, episode_key=None) as writer:
                    for step in steps:
                        writer.append(step)
                        done += 1
                        if done % 256 == 0 and time.perf_counter() - start > seconds:
                            break
                elapsed = time.perf_counter() - start
                out.append({"api": "Writer.append (per step)", "rows_per_s": done / elapsed})
                client.reset(kind)
                start = time.perf_counter()
                done = 0
                while done < n and time.perf_counter() - start < seconds:
                    client.insert(kind, {k: v[done:done + chunk] for k, v in rows.items()})
                    done += chunk
                elapsed = time.perf_counter() - start
                out.append({"api": f"insert ({chunk} rows per call)", "rows_per_s": done / elapsed})
            else:
                prefill = min(w.CAPACITY[kind], 20_000 if kind == "atari" else 200_000)
                chunk = 1_000 if kind == "atari" else 20_000
                for first in range(0, prefill, chunk):
                    client.insert(kind, _rows_as_torch(w.make_rows(kind, first, chunk)))
                if case == "sample":
                    # A client with REPLAY_SHARED_MEMORY=0 samples as one on another host
                    # does: the Sample call through gRPC (the plain client below, on this
                    # host, samples through its sample stream's shared-memory region).
                    os.environ["REPLAY_SHARED_MEMORY"] = "0"
                    try:  # (read when its sample stream is made: at its first sample)
                        remote = ReplayClient(address, timeout=120)
                        remote.sample(kind, w.SAMPLE_BATCH)
                    finally:
                        del os.environ["REPLAY_SHARED_MEMORY"]
                    rows = 0
                    start = time.perf_counter()
                    while time.perf_counter() - start < seconds:
                        rows += remote.sample(kind, w.SAMPLE_BATCH).batch_size
                    out.append({"api": f"sample (batch {w.SAMPLE_BATCH}, another host: gRPC)",
                                "rows_per_s": rows / (time.perf_counter() - start)})
                    remote.close()
                    # per_message None: the plain call, grouping chosen by the client.
                    for api, per_message, shm in (("sample", 1, False), ("stream", None, True),
                                                  ("stream", 1, False), ("stream", 8, False),
                                                  ("stream", 1, True)):
                        rows = 0
                        start = time.perf_counter()
                        if api == "sample":
                            while time.perf_counter() - start < seconds:
                                rows += client.sample(kind, w.SAMPLE_BATCH).batch_size
                        else:
                            for batch in client.stream(kind, w.SAMPLE_BATCH,
                                                       batches_per_message=per_message,
                                                       shared_memory=shm):
                                rows += batch.batch_size
                                if time.perf_counter() - start > seconds:
                                    break
                        elapsed = time.perf_counter() - start
                        if api == "sample":
                            grouped = ""
                        elif per_message is None:
                            grouped = ", plain: grouping chosen"
                        else:
                            grouped = f", {per_message} per message"
                            grouped += ", same-host shared memory" if shm else ", gRPC"
                        out.append({"api": f"{api} (batch {w.SAMPLE_BATCH}{grouped})",
                                    "rows_per_s": rows / elapsed})
                else:
                    ids = client.sample(kind, per_call).ids
                    priorities = [w.new_priorities(per_call, i) for i in range(64)]
                    # Waiting updates from another host take the call stream through gRPC
                    # (REPLAY_SHARED_MEMORY=0, read when the client's update stream is
                    # made); on this host they go over the local channel's Unix socket.
                    os.environ["REPLAY_SHARED_MEMORY"] = "0"
                    try:
                        remote = ReplayClient(address, timeout=120)
                        remote.update_priorities(kind, ids, priorities[0])
                    finally:
                        del os.environ["REPLAY_SHARED_MEMORY"]
                    done = i = 0
                    start = time.perf_counter()
                    while time.perf_counter() - start < seconds:
                        remote.update_priorities(kind, ids, priorities[i % 64])
                        done += per_call
                        i += 1
                    out.append({"api": f"update_priorities ({per_call} ids per call, another "
                                       f"host: gRPC)",
                                "ids_per_s": done / (time.perf_counter() - start)})
                    remote.close()
                    for wait in (True, False):
                        done = i = 0
                        start = time.perf_counter()
                        while time.perf_counter() - start < seconds:
                            client.update_priorities(kind, ids, priorities[i % 64], wait=wait)
                            done += per_call
                            i += 1
                        client.flush_updates()  # counted: every update was applied
                        mode = "" if wait else ", wait=False"
                        out.append({"api": f"update_priorities ({per_call} ids per call{mode})",
                                    "ids_per_s": done / (time.perf_counter() - start)})
                    out += _stream_updates(client, kind, ids, priorities, seconds)
            for record in out:
                if "rows_per_s" in record:
                    record["mb_per_s"] = record["rows_per_s"] * mb
            return out


def _variables(client, kind: str, seconds: float) -> list[dict]:
    """Publish and fetch of a policy's state dict (Reverb has no counterpart)."""
    import torch

    params = w.POLICY_PARAMS[kind]
    state = {f"layer{i}.weight": torch.randn(params // 4) for i in range(4)}
    mb = sum(t.numel() * t.element_size() for t in state.values()) / 1e6
    out = []
    for api in ("publish", "fetch"):
        calls = 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            if api == "publish":
                client.publish("policy", state)
            else:
                client.fetch("policy")
            calls += 1
        rate = calls / (time.perf_counter() - start)
        out.append({"api": f"{api} ({mb:.2f} MB state dict)", "calls_per_s": rate,
                    "mb_per_s": rate * mb})
    return out


def _stream_updates(client, kind: str, ids, priorities, seconds: float) -> list[dict]:  # type: ignore[no-untyped-def]
    """Updates on a learner's stream (``stream.update_priorities``, riding on its credits).

    * back to back: as many as fit ``seconds``, counted once the server has applied them
      all (its ``priority_updates`` counter), like the unary cases;
    * one per batch taken: the learner's loop ``next(stream)`` then an update of that
      many of its ids; ids/s over the time the learner spent in the update calls (each
      reaches the server before the draw its next credit allows), and the loop's rate
      (only for updates no larger than a batch).
    """
    per_call = len(ids)
    def applied() -> int:
        return client.info()[kind].counters["priority_updates"]

    out = []
    with client.stream(kind, w.SAMPLE_BATCH, prefetch=2, batches_per_message=1) as stream:
        next(stream)
        before, done, i = applied(), 0, 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            stream.update_priorities(ids, priorities[i % 64])
            done += per_call
            i += 1
        next(stream)  # its credit carries what is still held
        while applied() < before + done:
            time.sleep(0.001)
        out.append({"api": f"stream.update_priorities ({per_call} ids per call, back to back)",
                    "ids_per_s": done / (time.perf_counter() - start)})
        if per_call > w.SAMPLE_BATCH:
            return out
        in_calls, steps = 0.0, 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            batch = next(stream)
            mark = time.perf_counter()
            stream.update_priorities(batch.ids[:per_call], priorities[steps % 64])
            in_calls += time.perf_counter() - mark
            steps += 1
        loop = time.perf_counter() - start
        out.append({"api": f"stream.update_priorities ({per_call} ids after each batch taken; "
                           f"loop {steps / loop:,.0f} batches/s)",
                    "ids_per_s": steps * per_call / in_calls})
    return out


def _reverb(python: str, kind: str, case: str, seconds: float,
            per_call: int = w.UPDATE_BATCH) -> dict | None:
    cmd = [python, str(HERE / "reverb_service.py"), "--kind", kind, "--case", case,
           "--seconds", str(seconds), "--ids-per-call", str(per_call)]
    return run_side(cmd, timeout=900)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reverb-python", help="python of Reverb's virtualenv")
    parser.add_argument("--seconds", type=float, default=w.SECONDS)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--cases", default="insert,sample,update",
                        help="comma-separated subset of insert,sample,update,publish "
                             "(publish: ours alone, Reverb has no variables)")

    parser.add_argument("--kinds", default=",".join(w.ROW_KINDS),
                        help="comma-separated subset of " + ",".join(w.ROW_KINDS))
    args = parser.parse_args()

    results = []
    for kind in args.kinds.split(","):
        for case in args.cases.split(","):
            # Priority updates: one measurement per size (ours and Reverb's side by side).
            for per_call in (w.UPDATE_BATCHES if case == "update" else (w.UPDATE_BATCH,)):
                print(f"{kind} {case}", file=sys.stderr)
                ours = _ours(kind, case, args.seconds, per_call)
                theirs = (_reverb(args.reverb_python, kind, case, args.seconds, per_call)
                          if args.reverb_python and case != "publish" else None)
                results.append({"kind": kind, "case": case, "ours": ours, "reverb": theirs})
                print(f"  ours={ours}\n  reverb={theirs}", file=sys.stderr)
    print(_table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


def _table(results: list[dict]) -> str:
    import torch

    from report import BENCHMARKS, table  # the page's table (docs/benchmarks.md), one renderer

    head = (f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
            f"{platform.python_version()}, torch {torch.__version__}; loopback, one client "
            f"process\n\n")
    return head + table("service", BENCHMARKS["service"].rows(results))


if __name__ == "__main__":
    main()
