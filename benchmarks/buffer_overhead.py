"""RemoteReplayBuffer.sample's per-call cost beside the raw client's sample of the same batch.

    python benchmarks/buffer_overhead.py [--calls 300] [--batch 256] [--profile]

A server in its own process (loopback gRPC) holds a prioritized table and a
slice table of small transitions (obs float32[17], action, reward, done:
about 80 bytes a row), 20,000 rows each. This process times, call by call and
interleaved so that both see the same machine:

* ``raw``: ``client.sample(table, batch)`` (a ``SampleBatch``);
* ``raw + to_tensordict``: the same batch as a TensorDict (what a TorchRL
  loop would build from it by hand);
* ``buffer``: ``RemoteReplayBuffer(...).sample()`` of the same batch (steps,
  for the slice table): a TensorDict with ``index`` (positions),
  ``replay_id``, the weights and, for slices, TorchRL's markers.

It prints each one's median and 90th percentile per call in milliseconds and
the buffer's ratio to ``raw`` (the target: at most 1.2). ``--profile`` also
prints the cProfile of the buffer's calls (top functions by own time), which
says where the layer spends what it adds. Timings are the machine's: compare
ratios from one run, never absolute figures across machines.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from replay_client import RemoteReplayBuffer, ReplayClient  # noqa: E402
from sides import replay_server  # noqa: E402

ROWS = 20_000
CONFIG = """
[[tables]]
name = "replay"
capacity = 100000
sampler = "prioritized"
alpha = 0.6
beta = 0.4

[[tables]]
name = "slices"
capacity = 100000
sampler = "slice"
slice_len = 32
"""


def transitions(n: int, episode_len: int = 200) -> TensorDict:
    t = torch.arange(n)
    return TensorDict({"obs": torch.randn(n, 17), "action": t % 4, "reward": torch.randn(n),
                       "done": t % episode_len == episode_len - 1}, batch_size=[n])


def timed(call, calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        out.append((time.perf_counter() - start) * 1e3)
    return out


def figures(name: str, ms: list[float], base: float | None) -> str:
    median = statistics.median(ms)
    p90 = statistics.quantiles(ms, n=10)[-1]
    ratio = "" if base is None else f"  {median / base:5.2f}x raw"
    return f"  {name:<24} median {median:7.3f} ms   p90 {p90:7.3f} ms{ratio}"


def compare(client: ReplayClient, table: str, batch: int, calls: int, profile: bool) -> None:
    rb = RemoteReplayBuffer(client, table, batch_size=batch)
    draws = batch if table == "replay" else batch // 32
    raw = lambda: client.sample(table, draws)  # noqa: E731
    as_td = lambda: client.sample(table, draws).to_tensordict()  # noqa: E731
    for call in (raw, as_td, rb.sample):  # warm up (connections, info cache, allocator)
        timed(call, 20)
    results: dict[str, list[float]] = {"raw": [], "raw + to_tensordict": [], "buffer": []}
    for _ in range(calls // 10):  # interleaved rounds: the machine's noise hits all three
        results["raw"] += timed(raw, 10)
        results["raw + to_tensordict"] += timed(as_td, 10)
        results["buffer"] += timed(rb.sample, 10)
    base = statistics.median(results["raw"])
    print(f"table {table!r} ({'rows' if table == 'replay' else 'slices of 32'}), batch of "
          f"{batch} steps, {calls} calls each:")
    for name, ms in results.items():
        print(figures(name, ms, None if name == "raw" else base))
    if profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(calls):
            rb.sample()
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(18)
        print(text.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp, replay_server(Path(tmp), CONFIG) as address:
        client = ReplayClient(address, timeout=60)
        for table in ("replay", "slices"):
            RemoteReplayBuffer(client, table).extend(transitions(ROWS))
        for table in ("replay", "slices"):
            compare(client, table, args.batch, args.calls, args.profile)
        client.close()


if __name__ == "__main__":
    main()
