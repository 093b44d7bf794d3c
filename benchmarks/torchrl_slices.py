"""TorchRL side of the R2D2 flagship comparison (run in the TorchRL virtualenv).

    /path/to/torchrl/bin/python benchmarks/torchrl_slices.py --rows N --dir DIR \
        [--kind atari|small] [--seconds S]

TorchRL's equivalent of ``deploy/configs/r2d2_atari.toml``, through its public API:
``ReplayBuffer(storage=LazyMemmapStorage(N, scratch_dir=DIR),
sampler=PrioritizedSliceSampler(N, alpha=0.9, beta=0.6, slice_len=83,
end_key=("next", "done"), cache_values=True))`` with the transform
``reshape(-1, 83)`` -> ``CatFrames(N=4, dim=-3, padding="same")`` -> ``[:, 3:]``:
one frame stored per step, 64 slices of 80 steps of 4 stacked frames rebuilt at
sample time; ``rb.sample(return_info=True)`` (the rows, the weights and index;
a ``TensorDictReplayBuffer`` cannot write them into the reshaped batch). The
slices are 83 steps and the first 3 dropped so that every step
of the 80 gets its 3 previous frames from the episode, as the replay-server table
does (TorchRL pads a window at the slice's start otherwise); ``padding="same"``
repeats an episode's first frame before it, as the table's ``repeat`` fill.
``cache_values=True`` (TorchRL's fastest setting: the trajectory bounds are
computed once, as nothing is written between samples).

Rows: 8 actors replaying the recorded Atari frames (``benchmarks/data/atari_frames.npz``,
``--kind atari``: ``pixels`` ``[1, 84, 84]`` uint8), or small observations
(``--kind small``: ``[1, 17]`` float32, episodes of 1,000 steps), each actor's
steps written contiguously (TorchRL's slice samplers need an episode's steps
adjacent in storage; replay-server's tables take them interleaved). Prints one
JSON line on stdout (fill rows/s, ``sample(64 x 80)`` per second, the sample's
shape); logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TORCHRL_CONSOLE_STREAM", "stderr")
_JSON_OUT = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from torchrl.data import LazyMemmapStorage, ReplayBuffer  # noqa: E402
from torchrl.data.replay_buffers.samplers import PrioritizedSliceSampler  # noqa: E402
from torchrl.envs.transforms import CatFrames, Compose  # noqa: E402

FRAMES = Path(__file__).resolve().parent / "data" / "atari_frames.npz"
ACTORS, STACK, SLICES, SLICE_LEN, CHUNK = 8, 4, 64, 80, 1_000
WINDOW = SLICE_LEN + STACK - 1


def chunks(kind: str, rows: int):
    """``(pixels, done)`` chunks of one actor's contiguous steps, actors in turn."""
    if kind == "atari":
        data = np.load(FRAMES)
        frames, starts = data["frames"], data["starts"]
        first = np.zeros(len(frames), dtype=bool)
        first[starts] = True
    else:
        frames = np.random.default_rng(0).standard_normal((20_000, 17)).astype(np.float32)
        first = np.arange(len(frames)) % 1_000 == 0
    n = len(frames)
    written, turn = 0, 0
    while written < rows:
        actor, lap = turn % ACTORS, turn // ACTORS
        count = min(CHUNK, rows - written)
        frame = (lap * CHUNK + np.arange(count) + actor * (n // ACTORS)) % n
        done = first[(frame + 1) % n]
        yield torch.from_numpy(frames[frame]).unsqueeze(1), torch.from_numpy(done)
        written += count
        turn += 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--kind", choices=["atari", "small"], default="atari")
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sampler = PrioritizedSliceSampler(args.rows, alpha=0.9, beta=0.6, slice_len=WINDOW,
                                      end_key=("next", "done"), cache_values=True)
    cat = CatFrames(N=STACK, dim=-3 if args.kind == "atari" else -2, in_keys=["pixels"],
                    padding="same", done_key="done")
    transform = Compose(lambda td: td.reshape(-1, WINDOW).refine_names(None, "time"), cat,
                        lambda td: td[:, STACK - 1:])
    rb = ReplayBuffer(storage=LazyMemmapStorage(args.rows, scratch_dir=args.dir),
                      sampler=sampler, transform=transform, batch_size=SLICES * WINDOW)
    start = time.perf_counter()
    for pixels, done in chunks(args.kind, args.rows):
        n = len(done)
        rb.extend(TensorDict({"pixels": pixels, "action": torch.zeros(n, dtype=torch.int64),
                              "reward": torch.zeros(n), "next": {"done": done.unsqueeze(-1)}},
                             batch_size=[n]))
    fill = args.rows / (time.perf_counter() - start)
    os.sync()
    batch, info = rb.sample(return_info=True)  # the rows, and the slices' weights and index
    shape = list(batch["pixels"].shape)
    for _ in range(3):
        rb.sample(return_info=True)
    ops, start = 0, time.perf_counter()
    while time.perf_counter() - start < args.seconds or ops < 3:
        rb.sample(return_info=True)
        ops += 1
    _JSON_OUT.write(json.dumps({
        "side": "torchrl", "kind": args.kind, "rows": args.rows, "fill_rows_per_s": fill,
        "sample_per_s": ops / (time.perf_counter() - start), "shape": shape,
        "api": "LazyMemmapStorage + PrioritizedSliceSampler(slice_len=83) + CatFrames(N=4)"}) + "\n")


if __name__ == "__main__":
    main()
