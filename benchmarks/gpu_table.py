"""Device-resident tables against TorchRL's device-resident buffer: sampling with priority updates.

    python benchmarks/gpu_table.py --torchrl-python .venv-torchrl/bin/python [--device cuda]

(or ``make bench-gpu-table DEVICE=cuda``). Atari rows (84x84x4 uint8 frames,
an int32 action, a float32 reward, a bool done: 28,233 bytes) from
``benchmarks/service_workload.py``; ``--rows`` of them are inserted, then one
op is: sample 256 rows, then update their priorities with new ones that are
on the device (as a learner's TD errors are; float32, which TorchRL's sum tree
requires). Each side runs in its own fresh
process, one after the other (``--repeat N`` alternates them N times and
reports medians with the spread of the per-round ratios):

* **ours**: ``Table(TableConfig(sampler="prioritized", device=DEVICE))``:
  with ``--device cuda`` the columns live on the GPU and gather there
  (:mod:`replay_server.engine.storage.device`); with ``--device cpu`` it is
  the ordinary host table. ``table.sample(256)`` then
  ``table.update_priorities(batch.ids, priorities)``.
* **ours, stand-in** (``--device cpu`` only): the device storage's own code
  on the CPU through the test stand-in
  (:func:`~replay_server.engine.storage.placement.cpu_stand_in`), to show what
  that path costs on a host without a GPU. Not a GPU figure.
* **torchrl**: ``ReplayBuffer(storage=LazyTensorStorage(rows, device=DEVICE),
  sampler=PrioritizedSampler(rows, alpha, beta), batch_size=256)``;
  ``rb.sample(return_info=True)`` then ``rb.update_priority(info["index"], priorities)``.

With ``--device cuda`` every op ends with ``torch.cuda.synchronize()``, on
both sides, so an op's time includes its device work. Figures taken with
``--device cpu`` are CPU figures: they say nothing about a GPU.

``--side ours|standin|torchrl`` runs one measurement and prints one JSON line
(the orchestrator calls itself that way, TorchRL's side under ``--torchrl-python``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import service_workload as w  # noqa: E402

KIND = "atari"
BATCH = 256
FILL = 1_000
WARMUP = 5
MAX_OPS = 2_000


def _timed(op, device: str, seconds: float) -> dict:  # type: ignore[no-untyped-def]
    import torch

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for i in range(WARMUP):
        op(-1 - i)
    sync()
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(times) < MAX_OPS and (len(times) < 20 or time.perf_counter() < deadline):
        start = time.perf_counter()
        op(len(times))
        sync()
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return {"median_s": median, "batches_per_s": 1.0 / median, "ops": len(times)}


def _priorities(i: int, device: str):  # type: ignore[no-untyped-def]
    import torch

    return torch.from_numpy(w.new_priorities(BATCH, seed=i & 0xFFFF)).float().to(device)


def _ours(device: str, rows: int, seconds: float, stand_in: bool) -> dict:
    import torch

    from replay_server import Table, TableConfig
    from replay_server.engine.storage.placement import cpu_stand_in

    with cpu_stand_in() if stand_in else contextlib.nullcontext():
        table = Table(TableConfig(name="b", capacity=rows, sampler="prioritized", alpha=w.ALPHA,
                                  beta=w.BETA, seed=0, device="cuda" if stand_in else device))
        for first in range(0, rows, FILL):
            table.insert({k: torch.from_numpy(v) for k, v in w.make_rows(KIND, first, FILL).items()})
        where = "cpu" if stand_in else device

        def op(i: int) -> None:
            batch = table.sample(BATCH)
            table.update_priorities(batch.ids, _priorities(i, where))

        return {**_timed(op, where, seconds), "torch": torch.__version__,
                "storage": type(table._parts.storage).__name__}


def _torchrl(device: str, rows: int, seconds: float) -> dict:
    import torch
    import torchrl
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, PrioritizedSampler, ReplayBuffer

    rb = ReplayBuffer(storage=LazyTensorStorage(rows, device=device),
                      sampler=PrioritizedSampler(rows, w.ALPHA, w.BETA), batch_size=BATCH)
    for first in range(0, rows, FILL):
        chunk = {k: torch.from_numpy(v) for k, v in w.make_rows(KIND, first, FILL).items()}
        rb.extend(TensorDict(chunk, batch_size=[FILL]))

    def op(i: int) -> None:
        _, info = rb.sample(return_info=True)
        rb.update_priority(info["index"], _priorities(i, device))

    return {**_timed(op, device, seconds), "torch": torch.__version__,
            "torchrl": torchrl.__version__}


def _side(args: argparse.Namespace) -> None:
    if args.side == "torchrl":
        result = _torchrl(args.device, args.rows, args.seconds)
    else:
        result = _ours(args.device, args.rows, args.seconds, args.side == "standin")
    print(json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", choices=["ours", "standin", "torchrl"],
                        help="run one measurement (internal)")
    parser.add_argument("--device", default="cpu", help="cpu (CPU figures) or cuda[:N]")
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--torchrl-python", help="python of TorchRL's virtualenv")
    args = parser.parse_args()
    if args.side:
        _side(args)
        return
    from sides import run_side

    common = ["--device", args.device, "--rows", str(args.rows), "--seconds", str(args.seconds)]
    sides = ["ours"] + (["standin"] if args.device == "cpu" else [])
    runs: dict[str, list[dict]] = {side: [] for side in [*sides, "torchrl"]}
    for _ in range(args.repeat):
        for side in sides:
            record = run_side([sys.executable, __file__, "--side", side, *common], 1800)
            if record:
                runs[side].append(record)
        if args.torchrl_python:
            record = run_side([args.torchrl_python, __file__, "--side", "torchrl", *common], 1800)
            if record:
                runs["torchrl"].append(record)
    what = "GPU" if args.device.startswith("cuda") else "CPU (not GPU figures)"
    print(f"\n## Prioritized sample {BATCH} + priority update, {args.rows:,} Atari rows, "
          f"device {args.device}: {what}\n")
    print(f"python {platform.python_version()}, {args.repeat} round(s), median op per run, "
          f"median run per side\n")
    theirs = [r["batches_per_s"] for r in runs["torchrl"]]
    print("| side | batches/s | x TorchRL (per-round range) |\n|---|---|---|")
    for side in [*sides, "torchrl"]:
        rates = [r["batches_per_s"] for r in runs[side]]
        if not rates:
            print(f"| {side} | failed or not run | |")
            continue
        ratio = ""
        if theirs and side != "torchrl":
            per_round = [a / b for a, b in zip(rates, theirs)]
            ratio = (f"{statistics.median(rates) / statistics.median(theirs):.2f}x "
                     f"({min(per_round):.2f}-{max(per_round):.2f})")
        label = {"ours": "replay-server", "standin": "replay-server, device code on CPU "
                 "(stand-in)", "torchrl": f"TorchRL {runs[side][0].get('torchrl', '')}"}[side]
        print(f"| {label} | {statistics.median(rates):,.0f} | {ratio} |")


if __name__ == "__main__":
    main()
