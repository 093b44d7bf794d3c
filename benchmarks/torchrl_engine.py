"""TorchRL side of the engine benchmark (run in the ``.venv-torchrl`` virtualenv).

Usage::

    .venv-torchrl/bin/python benchmarks/torchrl_engine.py --case CASE \
        [--rows N] [--batch B] [--seconds S]

CASE is one of ``prioritized``, ``slice``, ``insert``, ``memory``. The script
prints one JSON object per measurement on stdout (JSON lines) and nothing
else; progress and diagnostics go to stderr. It stores and times the rows of
the shared workload module ``benchmarks/workload.py`` with TorchRL's
in-process replay buffers (``LazyTensorStorage`` on CPU), through TorchRL's
ordinary public API:

- prioritized: ``ReplayBuffer(storage=LazyTensorStorage(rows),
  sampler=PrioritizedSampler(rows, ALPHA, BETA))``; one op is
  ``rb.sample(return_info=True)`` (data + ``info["index"]`` +
  ``info["priority_weight"]``) then ``rb.update_priority(index, priority)``.
- slice: ``TensorDictReplayBuffer(storage=LazyTensorStorage(rows),
  sampler=SliceSampler(slice_len=SLICE_LEN, end_key="done"))``. TorchRL's
  docs recommend ``end_key`` over ``traj_key`` for speed; ``--slice-key
  episode`` selects ``traj_key="episode"`` instead. ``cache_values`` stays at
  its default (False): in torchrl 0.14.1 its cache is keyed on the storage's
  mutation revision, so every ``extend`` between samples invalidates it anyway.
- insert: ``ReplayBuffer(storage=LazyTensorStorage(1_000_000))`` with the
  default RandomSampler and RoundRobinWriter; times ``extend``.
- memory: the prioritized buffer of MEMORY_ROWS rows (obs, reward, done only),
  RSS growth measured with psutil.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# stdout carries the JSON lines only. TorchRL's logger writes to stdout by
# default (it prints e.g. "Initialized LazyTensorStorage ..."), so send it to
# stderr, and point file descriptor 1 itself at stderr so that nothing else
# (Python or native code) can reach the real stdout: the JSON goes to a
# duplicate of the original descriptor.
os.environ.setdefault("TORCHRL_CONSOLE_STREAM", "stderr")
sys.stdout.flush()
_JSON_OUT = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from torchrl.data import (  # noqa: E402
    LazyTensorStorage,
    PrioritizedSampler,
    ReplayBuffer,
    SliceSampler,
    TensorDictReplayBuffer,
)

import workload as W  # noqa: E402

INSERT_CAPACITY = 1_000_000
PRIORITIZED_MAX_OPS = 200
SLICE_MAX_OPS = 100
WARMUP_OPS = 5


def log(msg: str) -> None:
    print(f"[torchrl_engine] {msg}", file=sys.stderr, flush=True)


def emit(obj: dict) -> None:
    _JSON_OUT.write(json.dumps(obj) + "\n")
    _JSON_OUT.flush()


def versions() -> dict:
    import tensordict
    import torchrl

    return {
        "torch": torch.__version__,
        "torchrl": torchrl.__version__,
        "tensordict": tensordict.__version__,
        "threads": torch.get_num_threads(),
    }


def make_td(first_row: int, n: int, keys: tuple[str, ...] | None = None) -> TensorDict:
    rows = W.make_rows(first_row, n)
    if keys is not None:
        rows = {k: rows[k] for k in keys}
    return TensorDict(rows, batch_size=[n])


def fill(rb, rows: int, keys: tuple[str, ...] | None = None) -> float:
    """Extends ``rb`` with rows 0..rows-1 in chunks of FILL_CHUNK; returns seconds."""
    t0 = time.perf_counter()
    done = 0
    while done < rows:
        n = min(W.FILL_CHUNK, rows - done)
        rb.extend(make_td(done, n, keys))
        done += n
        if done % (10 * W.FILL_CHUNK) == 0 or done == rows:
            log(f"filled {done:,}/{rows:,} rows ({time.perf_counter() - t0:.1f} s)")
    return time.perf_counter() - t0


def make_prioritized(rows: int) -> ReplayBuffer:
    return ReplayBuffer(
        storage=LazyTensorStorage(rows),
        sampler=PrioritizedSampler(max_capacity=rows, alpha=W.ALPHA, beta=W.BETA),
    )


def compiled_sum_tree(rb: ReplayBuffer) -> str:
    """The name of the sum tree ``rb``'s prioritized sampler uses, which must be TorchRL's
    compiled one (``torchrl._torchrl``); exits with an error naming what was found otherwise
    (a TorchRL wheel without its extension for this torch: the anchor would not be TorchRL's
    real speed)."""
    tree = getattr(rb._sampler, "_sum_tree", None)
    module = type(tree).__module__
    if tree is None or not module.startswith("torchrl._torchrl"):
        sys.exit(f"torchrl_engine: TorchRL's prioritized sampler does not use its compiled sum "
                 f"tree (found {module}.{type(tree).__name__}); install a TorchRL built for "
                 f"torch {torch.__version__} (its _torchrl extension)")
    return f"{module}.{type(tree).__name__}"


def case_prioritized(args) -> None:
    rows, batch = args.rows, args.batch
    rb = make_prioritized(rows)
    fill_s = fill(rb, rows)
    assert len(rb) == rows
    tree = compiled_sum_tree(rb)

    def op(i: int):
        prio = W.new_priorities(batch, seed=i)  # generated outside the timed region
        c0, t0 = time.thread_time(), time.perf_counter()
        data, info = rb.sample(batch, return_info=True)
        index, weight = info["index"], info["priority_weight"]
        t1 = time.perf_counter()
        rb.update_priority(index, prio)
        t2 = time.perf_counter()
        cpu_s.append(time.thread_time() - c0)
        return t1 - t0, t2 - t1, data, index, weight

    cpu_s: list[float] = []

    for i in range(WARMUP_OPS):
        _, _, data, index, weight = op(i)
    # Sanity (untimed): shapes and weights as expected.
    assert data.batch_size == torch.Size([batch]), data.batch_size
    assert index.shape == (batch,) and weight.shape == (batch,)
    assert float(weight.max()) <= 1.0 + 1e-6 and float(weight.min()) > 0

    sample_s, update_s, total = [], [], []
    del cpu_s[:]
    start = time.perf_counter()
    i = WARMUP_OPS
    while len(total) < PRIORITIZED_MAX_OPS and time.perf_counter() - start < args.seconds:
        s, u, *_ = op(i)
        sample_s.append(s)
        update_s.append(u)
        total.append(s + u)
        i += 1
    emit(
        {
            "impl": "torchrl",
            "case": "prioritized",
            "rows": rows,
            "batch": batch,
            "median_s": statistics.median(total),
            "mean_s": statistics.fmean(total),
            "ops": len(total),
            "sample_median_s": statistics.median(sample_s),
            "update_median_s": statistics.median(update_s),
            "cpu_median_s": statistics.median(cpu_s),
            "sum_tree": tree,
            "fill_s": fill_s,
            **versions(),
        }
    )


def check_slices(sample: TensorDict) -> None:
    """Untimed check that each slice is SLICE_LEN consecutive steps of one episode."""
    ep = sample["episode"].reshape(W.SLICE_BATCH, W.SLICE_LEN)
    done = sample["done"].reshape(W.SLICE_BATCH, W.SLICE_LEN)
    assert (ep == ep[:, :1]).all(), "a slice spans two episodes"
    assert not done[:, :-1].any(), "a slice continues past an episode end"


def case_slice(args) -> None:
    rows = args.rows
    if args.slice_key == "episode":
        sampler = SliceSampler(slice_len=W.SLICE_LEN, traj_key="episode")
    else:
        sampler = SliceSampler(slice_len=W.SLICE_LEN, end_key="done")
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(rows), sampler=sampler)
    fill_s = fill(rb, rows)
    assert len(rb) == rows
    sample_batch = W.SLICE_BATCH * W.SLICE_LEN
    next_row = rows

    def op():
        nonlocal next_row
        new = make_td(next_row, W.SLICE_INSERT_ROWS)  # generated outside the timed region
        next_row += W.SLICE_INSERT_ROWS
        t0 = time.perf_counter()
        rb.extend(new)
        t1 = time.perf_counter()
        sample = rb.sample(sample_batch)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, sample

    for _ in range(2):
        _, _, sample = op()
    assert sample.batch_size == torch.Size([sample_batch]), sample.batch_size
    check_slices(sample)

    extend_s, sample_s = [], []
    start = time.perf_counter()
    while len(sample_s) < SLICE_MAX_OPS and time.perf_counter() - start < args.seconds:
        e, s, sample = op()
        extend_s.append(e)
        sample_s.append(s)
    check_slices(sample)
    emit(
        {
            "impl": "torchrl",
            "case": "slice",
            "rows": rows,
            "batch": W.SLICE_BATCH,
            "slice_len": W.SLICE_LEN,
            "insert_rows": W.SLICE_INSERT_ROWS,
            "median_s": statistics.median(sample_s),
            "mean_s": statistics.fmean(sample_s),
            "extend_median_s": statistics.median(extend_s),
            "extend_mean_s": statistics.fmean(extend_s),
            "ops": len(sample_s),
            "slice_key": args.slice_key,
            "fill_s": fill_s,
            **versions(),
        }
    )


def case_insert(args) -> None:
    batch = args.batch
    # Pre-generate two passes over the capacity (so the ring wraps), as views of
    # one block of rows, before timing.
    capacity = args.rows
    total_rows = max(2 * capacity, 2 * batch)
    n_chunks = total_rows // batch
    block = make_td(0, n_chunks * batch)
    chunks = [block[i * batch : (i + 1) * batch] for i in range(n_chunks)]
    rb = ReplayBuffer(storage=LazyTensorStorage(capacity))
    rb.extend(make_td(0, batch))  # warm-up: lazily allocates the storage
    rb.empty()

    times = []
    start = time.perf_counter()
    for chunk in chunks:
        t0 = time.perf_counter()
        rb.extend(chunk)
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - start > args.seconds:
            break
    elapsed = sum(times)
    rows_done = len(times) * batch
    emit(
        {
            "impl": "torchrl",
            "case": "insert",
            "rows": capacity,
            "batch": batch,
            "rows_per_s": rows_done / elapsed,
            "median_s": statistics.median(times),
            "mean_s": statistics.fmean(times),
            "ops": len(times),
            "rows_inserted": rows_done,
            **versions(),
        }
    )


def rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def case_memory(args) -> None:
    rows = args.rows
    # Touch the workload once so torch's allocator and lazy imports are warm.
    make_td(0, 1000)
    before = W.resident_bytes(trim=True)
    rb = make_prioritized(rows)
    fill_s = fill(rb, rows, keys=("obs", "reward", "done"))
    untrimmed = W.resident_bytes(trim=False)
    after = W.resident_bytes(trim=True)
    assert len(rb) == rows
    raw = rows * W.ROW_BYTES_NO_EPISODE
    emit(
        {
            "impl": "torchrl",
            "case": "memory",
            "rows": rows,
            "rss_growth_bytes": after - before,
            "raw_bytes": raw,
            "overhead_ratio": (after - before) / raw,
            "ratio": (after - before) / raw,
            "ratio_untrimmed": (untrimmed - before) / raw,
            "fill_s": fill_s,
            **versions(),
        }
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", required=True, choices=["prioritized", "slice", "insert", "memory"])
    p.add_argument("--rows", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seconds", type=float, default=None)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads(N); default: leave torch's default (one per core)",
    )
    p.add_argument(
        "--slice-key",
        choices=["done", "episode"],
        default="done",
        help="slice case: SliceSampler(end_key='done') (default) or traj_key='episode'",
    )
    args = p.parse_args(argv)
    defaults = {
        "prioritized": (W.PRIORITIZED_ROWS[0], W.PRIORITIZED_BATCHES[0], 5.0),
        "slice": (W.SLICE_ROWS[0], W.SLICE_BATCH, 10.0),
        "insert": (INSERT_CAPACITY, W.INSERT_ROWS_PER_CALL[0], 10.0),
        "memory": (W.MEMORY_ROWS, None, None),
    }[args.case]
    if args.rows is None:
        args.rows = defaults[0]
    if args.batch is None:
        args.batch = defaults[1]
    if args.seconds is None:
        args.seconds = defaults[2]
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    log(f"case={args.case} rows={args.rows} batch={args.batch} seconds={args.seconds} {versions()}")
    {
        "prioritized": case_prioritized,
        "slice": case_slice,
        "insert": case_insert,
        "memory": case_memory,
    }[args.case](args)


if __name__ == "__main__":
    main()
