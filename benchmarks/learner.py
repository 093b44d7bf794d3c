"""Learner benchmark: batches delivered to a learner, over gRPC and shared memory, vs Reverb's dataset.

    python benchmarks/learner.py --reverb-python .venv-reverb/bin/python [--device cuda]

(or ``make bench-learner``). Atari-size rows (84x84x4 uint8 frames plus a few
scalars, about 28 KB), a prioritized table of 20,000 rows, batches of 256
(about 7.2 MB). The server runs in its own process; this process is the
learner, iterating ``client.stream`` (prefetch 2) and counting batches and
bytes delivered over ``--seconds``:

* ``grpc``: the stream over loopback gRPC (``shared_memory=False``);
* ``shared memory``: the same stream through the server's /dev/shm ring;
* ``in process``: an embedded server's tables sampled in the learner's process;
* Reverb: ``reverb.TrajectoryDataset(...).batch(256)`` against a Reverb server
  with the same table, in its own virtualenv (``benchmarks/reverb_service.py``).

"Delivered" means the batch is a set of torch tensors in the learner's
process, ready to use (host batches are views of the stream's ring; nothing
is copied again). With ``--device cuda`` each path also delivers to the GPU,
and a plain pinned ``tensor.to("cuda", non_blocking=True)`` of the same bytes
is timed in the same run as the ceiling for the host-to-device part.
``--transform`` gives each stream a learner-side transform (frames to float32
in [0, 1]: 4x the bytes), run on the feed's delivery stage.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import service_workload as w  # noqa: E402
from sides import replay_server, run_side  # noqa: E402

KIND = "atari"
PREFILL = 20_000
WARMUP_BATCHES = 5


_CONFIG = (
    "[server]\nmax_message_mb = 64\nworkers = 2\n"
    f'[[tables]]\nname = "{KIND}"\ncapacity = {w.CAPACITY[KIND]}\n'
    f'sampler = "prioritized"\nalpha = {w.ALPHA}\nbeta = {w.BETA}\n'
)


def _fill(insert) -> None:  # type: ignore[no-untyped-def]
    import torch

    for first in range(0, PREFILL, 1_000):
        rows = w.make_rows(KIND, first, 1_000)
        insert({key: torch.from_numpy(value) for key, value in rows.items()})


def _drive(stream, seconds: float) -> dict:  # type: ignore[no-untyped-def]
    """Iterate ``stream`` for ``seconds`` after a warm-up; batches/s and GB/s delivered."""
    import torch

    with stream:
        for _ in range(WARMUP_BATCHES):
            next(stream)
        before = stream.stats.bytes
        batches = 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            batch = next(stream)
            batches += 1
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        nbytes = stream.stats.bytes - before
        assert len(batch["ids"] if isinstance(batch, dict) else batch.ids) == w.SAMPLE_BATCH
        return {"batches_per_s": batches / elapsed, "gb_per_s": nbytes / elapsed / 1e9,
                "batches": batches, "transport": stream.transport,
                "wait_s": stream.stats.wait_s, "notes": stream.stats.notes}


def _plain_copy(nbytes: int, seconds: float) -> dict:
    """GB/s of a plain pinned host tensor copied with ``.to("cuda", non_blocking=True)``."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    for _ in range(5):
        host.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    copies = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        host.to("cuda", non_blocking=True)
        copies += 1
        if copies % 8 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return {"batches_per_s": copies / elapsed, "gb_per_s": copies * nbytes / elapsed / 1e9}


def _to_float(batch):  # type: ignore[no-untyped-def]
    """The ``--transform``: frames as float32 in [0, 1], the rest as it is."""
    return {"frames": batch.data["obs"].float().div_(255), "ids": batch.ids,
            "weights": batch.weights}


def ours(seconds: float, device: str | None, transform: bool = False) -> dict[str, dict]:
    import torch

    from replay_client import ReplayClient
    from replay_server.app.embedded import EmbeddedServer
    from replay_server.app.config_file import settings_from_dict

    torch.set_num_threads(1)
    options = {"transform": _to_float} if transform else {}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        with replay_server(Path(tmp), _CONFIG) as address:
            client = ReplayClient(address, timeout=120)
            _fill(lambda rows: client.insert(KIND, rows))
            for name, shm in (("grpc", False), ("shared memory", True)):
                stream = client.stream(KIND, w.SAMPLE_BATCH, prefetch=2, shared_memory=shm,
                                       device=device, **options)
                results[name] = _drive(stream, seconds)
                print(f"  {name}: {results[name]}", file=sys.stderr)
            client.close()
    settings = settings_from_dict(tomllib.loads(_CONFIG))  # the same table, in this process
    with EmbeddedServer(settings, listen=False) as server:
        _fill(server.tables[KIND].insert)
        results["in process"] = _drive(
            server.stream(KIND, w.SAMPLE_BATCH, prefetch=2, device=device, **options), seconds)
        print(f"  in process: {results['in process']}", file=sys.stderr)
    if device is not None:
        nbytes = w.SAMPLE_BATCH * w.row_bytes(KIND)
        results["plain pinned copy"] = _plain_copy(nbytes, seconds)
    return results


def reverb(python: str, seconds: float) -> dict | None:
    cmd = [python, str(HERE / "reverb_service.py"), "--kind", KIND, "--case", "sample",
           "--api", "trajectory_dataset", "--seconds", str(seconds)]
    result = run_side(cmd, timeout=900)
    if result is not None:
        result["batches_per_s"] = result["rows_per_s"] / w.SAMPLE_BATCH
        result["gb_per_s"] = result["mb_per_s"] / 1e3
    return result


def table(results: dict[str, dict], theirs: dict | None, device: str | None) -> str:
    import torch

    head = (f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
            f"{platform.python_version()}, torch {torch.__version__}; Atari rows "
            f"({w.row_bytes(KIND):,} bytes), batch {w.SAMPLE_BATCH}, prefetch 2, "
            f"delivered to {device or 'host memory'}\n\n")
    lines = ["| path | batches/s | GB/s | vs Reverb dataset | vs plain pinned copy |",
             "|---|---:|---:|---:|---:|"]
    plain = results.get("plain pinned copy")
    for name, r in results.items():
        vs_reverb = f"{r['gb_per_s'] / theirs['gb_per_s']:.2f}x" if theirs and name != "plain pinned copy" else "n/a"
        vs_plain = f"{r['gb_per_s'] / plain['gb_per_s']:.0%}" if plain else "n/a"
        lines.append(f"| {name} | {r['batches_per_s']:,.1f} | {r['gb_per_s']:.2f} | {vs_reverb} | {vs_plain} |")
    if theirs:
        lines.append(f"| Reverb {theirs.get('reverb_version', '')} TrajectoryDataset | "
                     f"{theirs['batches_per_s']:,.1f} | {theirs['gb_per_s']:.2f} | 1.00x | n/a |")
    return head + "\n".join(lines)


def main() -> None:
    global PREFILL
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reverb-python", help="python of Reverb's virtualenv")
    parser.add_argument("--seconds", type=float, default=w.SECONDS)
    parser.add_argument("--device", default=None, help="e.g. cuda: deliver to the GPU")
    parser.add_argument("--transform", action="store_true",
                        help="a learner-side transform (frames to float32) on every stream")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--prefill", type=int, default=PREFILL,
                        help="rows inserted before measuring (fewer: quicker, for make gpu-check's "
                             "short run; the figures then come from a smaller table)")
    args = parser.parse_args()
    PREFILL = args.prefill
    print("ours", file=sys.stderr)
    results = ours(args.seconds, args.device, args.transform)
    theirs = None
    if args.reverb_python:
        print("reverb", file=sys.stderr)
        theirs = reverb(args.reverb_python, args.seconds)
        print(f"  reverb: {theirs}", file=sys.stderr)
    print(table(results, theirs, args.device))
    if args.json:
        args.json.write_text(json.dumps({"ours": results, "reverb": theirs}, indent=1))


if __name__ == "__main__":
    main()
