"""Ray benchmark: ``ReplayCluster`` (1 and 2 shards) against TorchRL's ``RayReplayBuffer``.

    python benchmarks/ray_buffers.py --json results/ray.json \\
        --torchrl-python /work/venvs/torchrl/bin/python

Each side runs in its own Python (TorchRL needs another torch than this
project's, so its side runs from its own virtualenv, with Ray of the same
version) on a local Ray cluster of the same shape, started by that side:
``ray.cluster_utils.Cluster`` with two nodes of one CPU each on 127.0.0.1
(``node_a``, ``node_b`` custom resources), the buffer actors taking no CPU.
The sides alternate for ``--rounds`` rounds (``ours``, ``torchrl``, ``ours``,
...), and the ratios are of the medians.

Per side, for small rows (17 float32 + action + reward) and Atari rows
(84x84x4 uint8 + action + reward), both prioritized:

* ``insert``: two writers as Ray actors, one on each node, each appending
  ``--insert-rows`` rows in calls of ``--insert-batch`` after one call
  untimed (which connects: ours resolves the shards through the registry) (ours: one
  ``client.insert`` per call over every shard; TorchRL: ``rb.extend``); once
  both have, they start their timed calls at one common instant (so neither
  side's figure holds a worker's start or a connection); rows per second
  from that instant to the last writer's end (each writer's own rate beside
  it). An insert is acknowledged alike on both sides: the call returns once
  the buffer holds the rows (ours: the shard's answer with their ids;
  TorchRL: ``ray.get`` of the actor's ``extend``), and a sample after it can
  draw them.
* ``stream``: a learner task on ``node_b`` draws ``--batches`` batches of 256
  small rows (``--atari-batches`` of Atari rows) from a filled buffer (ours:
  ``client.stream``, credit-driven over every shard; TorchRL: ``rb.sample()``,
  one actor call each); batches per second. Small rows take 2,000 batches:
  at 200 (the count until 2026-11-29) our two-shard stream was timed for
  0.05-0.15 s, a figure of its start (its first batch alone, its grouping
  chosen at the first chunk, its window widening) more than of its rate.

Ours also records: the time ``ReplayCluster.create`` takes until every shard
serves (TorchRL: the constructor until the first ``len`` answers), each
buffer actor's resident memory after the Atari fill, and, with 2 shards and a
checkpoint directory, how long a killed shard takes until the registry says
it serves again and until a degraded client's samples draw from it again.

``--kinds`` and ``--figures`` (``insert``, ``stream``, ``rejoin``) run a part.
The JSON (``--json``) holds every round's figures; the table printed is the
medians and ratios. Run ``--side ours`` or ``--side torchrl`` to run one side
once (it prints one JSON line).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # nodes on 127.0.0.1
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from sides import run_side

NODE_A = {"node_a": 0.001}
NODE_B = {"node_b": 0.001}
SMALL, ATARI = "small", "atari"
BATCH = 256


def rows(kind: str, n: int, first: int = 0) -> dict:
    """``n`` rows of ``kind`` as a dict of tensors (keys ``obs``, ``action``, ``reward``)."""
    import torch

    if kind == SMALL:
        obs = torch.randn(n, 17)
    else:
        obs = torch.randint(0, 255, (n, 84, 84, 4), dtype=torch.uint8)
    return {"obs": obs, "action": torch.arange(first, first + n, dtype=torch.int64) % 6,
            "reward": torch.rand(n)}


def rss_mib(pid: int) -> float:
    """Resident memory of process ``pid`` in MiB (``VmRSS``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def start_cluster():
    """Two nodes of one CPU each on 127.0.0.1; this process connected as the driver."""
    import ray
    from ray.cluster_utils import Cluster

    began = time.monotonic()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"node_a": 1}, "include_dashboard": False,
        "object_store_memory": 512 * 2**20})
    cluster.add_node(num_cpus=1, resources={"node_b": 1}, object_store_memory=512 * 2**20,
                     wait=True)
    ray.init(address=cluster.address, logging_level="warning", log_to_driver=False)
    nodes = {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    if nodes != {"127.0.0.1"}:
        raise RuntimeError(f"Ray nodes are not on loopback: {nodes}")
    return cluster, time.monotonic() - began


def capacity(kind: str, args) -> int:
    return args.capacity_small if kind == SMALL else args.capacity_atari


START_MARGIN_S = 0.5
"""How far ahead of the moment every writer is ready their common start is set."""


def batches(kind: str, args) -> int:
    return args.batches if kind == SMALL else args.atari_batches


def wait_until(instant: float) -> float:
    """Sleep until wall-clock ``instant`` (``time.time()``, one clock for every process of the
    one-host cluster); returns the instant it woke."""
    time.sleep(max(0.0, instant - time.time()))
    return time.time()


def inserts(key: str, args, writers: list) -> dict:
    """Both writers' figures. ``writers``: one writer actor per node (``ready()`` makes the
    untimed call, ``run(count, start_at)`` the timed ones from ``start_at``, returning its
    ``(began, ended)``), stopped here.

    Every writer has started, connected and made its untimed call before one common
    start is set, so neither side's figure holds a worker's start or a connection.
    ``insert_rows_s``: rows of both writers from the common start to the last one's end;
    ``insert_writer_rows_s``: each writer's own rows per second."""
    import ray

    try:
        ray.get([w.ready.remote() for w in writers])
        start_at = time.time() + START_MARGIN_S
        spans = ray.get([w.run.remote(args.insert_rows, start_at) for w in writers])
    finally:
        for writer in writers:
            ray.kill(writer)
    rows_each = (args.insert_rows // args.insert_batch) * args.insert_batch
    return {f"{key}/insert_rows_s": len(spans) * rows_each / (max(e for _, e in spans)
                                                              - min(b for b, _ in spans)),
            f"{key}/insert_writer_rows_s": [rows_each / (e - b) for b, e in spans],
            f"{key}/insert_start_skew_s": max(b for b, _ in spans) - min(b for b, _ in spans)}


# ------------------------------------------------------------------ ours


def ours(args) -> dict:
    import ray
    from replay_server.ray import ReplayCluster

    cluster, ray_start = start_cluster()
    out: dict = {"side": "ours", "ray_start_s": ray_start}

    @ray.remote(num_cpus=0)
    class Writer:
        def __init__(self, client, kind: str, batch: int) -> None:
            self.client, self.data = client, rows(kind, batch)

        def ready(self) -> None:
            self.client.insert("t", self.data)  # connected (through the registry), untimed

        def run(self, count: int, start_at: float) -> tuple[float, float]:
            began = wait_until(start_at)
            for _ in range(count // len(self.data["reward"])):
                self.client.insert("t", self.data)
            return began, time.time()

    @ray.remote(num_cpus=0)
    def learn(client, batches: int) -> float:
        stream = client.stream("t", BATCH, num_batches=batches + 2)
        it = iter(stream)
        next(it), next(it)  # the stream is open and filling its prefetch
        began = time.monotonic()
        for _ in it:
            pass
        elapsed = time.monotonic() - began
        stream.close()
        return elapsed

    try:
        for shards in args.shards:
            for kind in args.kinds:
                key = f"{shards}-shards/{kind}"
                tables = [{"name": "t", "capacity": capacity(kind, args),
                           "sampler": "prioritized"}]
                began = time.monotonic()
                replay = ReplayCluster.create(
                    f"bench-{shards}-{kind}", tables=tables, num_shards=shards,
                    shard_options=[{"num_cpus": 0, "resources": r}
                                   for r in (NODE_A, NODE_B)][:shards],
                    registry_options={"resources": NODE_A}, checkpoint_interval_s=0,
                    get_if_exists=False)
                out[f"{key}/start_s"] = time.monotonic() - began
                client = replay.client()
                try:
                    if "insert" in args.figures:
                        out.update(inserts(key, args, [Writer.options(resources=r).remote(
                            client, kind, args.insert_batch) for r in (NODE_A, NODE_B)]))
                    if "stream" not in args.figures:
                        continue
                    fill = capacity(kind, args) - client.info()["t"].size
                    for start in range(0, max(fill, 0), 1024):
                        client.insert("t", rows(kind, min(1024, fill - start)))
                    elapsed = ray.get(learn.options(resources=NODE_B).remote(
                        client, batches(kind, args)))
                    out[f"{key}/stream_batches_s"] = batches(kind, args) / elapsed
                    if kind == ATARI:
                        out[f"{key}/shard_rss_mib"] = [rss_mib(s["pid"])
                                                       for s in replay.states()]
                finally:
                    client.close()
                    replay.shutdown()
        if 2 in args.shards and "rejoin" in args.figures:
            out.update(rejoin(args))
    finally:
        ray.shutdown()
        cluster.shutdown()
    return out


def rejoin(args) -> dict:
    """Kill shard 1 of a checkpointed 2-shard replay: seconds until it serves again and until
    a degraded client's samples draw from it again."""
    import ray
    from replay_server.ray import ReplayCluster

    with tempfile.TemporaryDirectory() as folder:
        replay = ReplayCluster.create(
            "bench-rejoin", tables=[{"name": "t", "capacity": args.capacity_small,
                                     "sampler": "prioritized"}], num_shards=2,
            shard_options=[{"num_cpus": 0, "resources": r} for r in (NODE_A, NODE_B)],
            registry_options={"resources": NODE_A}, checkpoint_dir=folder,
            checkpoint_interval_s=0, get_if_exists=False)
        client = replay.client(allow_degraded=True, resolve_interval_s=1)
        try:
            for _ in range(min(10, args.capacity_small // 1000)):
                client.insert("t", rows(SMALL, 1000))
            replay.checkpoint()
            incarnation = replay.states()[1]["incarnation"]
            began = time.monotonic()
            ray.kill(replay.shards[1], no_restart=False)
            serving = drawn = None
            deadline = began + 120
            while time.monotonic() < deadline and drawn is None:
                state = replay.states()[1]
                if serving is None and state["state"] == "serving" and (
                        state["incarnation"] > incarnation):
                    serving = time.monotonic() - began
                batch = client.sample("t", 64)
                if serving is not None and batch.missing_shards == () and 1 in set(
                        (batch.ids >> 56).tolist()):
                    drawn = time.monotonic() - began
                time.sleep(0.02)
            return {"rejoin/serving_s": serving, "rejoin/sampled_s": drawn}
        finally:
            client.close()
            replay.shutdown()


# ------------------------------------------------------------------ TorchRL


def torchrl_side(args) -> dict:
    import ray
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, PrioritizedSampler, RayReplayBuffer

    cluster, ray_start = start_cluster()
    out: dict = {"side": "torchrl", "ray_start_s": ray_start}

    def as_td(data: dict) -> TensorDict:
        return TensorDict(data, batch_size=[len(data["reward"])])

    @ray.remote(num_cpus=0)
    class Writer:
        def __init__(self, client, kind: str, batch: int) -> None:
            self.client, self.data = client, as_td(rows(kind, batch))

        def ready(self) -> None:
            self.client.extend(self.data)  # as ours: one call before the clock starts

        def run(self, count: int, start_at: float) -> tuple[float, float]:
            began = wait_until(start_at)
            for _ in range(count // len(self.data)):
                self.client.extend(self.data)
            return began, time.time()

    @ray.remote(num_cpus=0)
    def learn(client, batches: int) -> float:
        client.sample(), client.sample()
        began = time.monotonic()
        for _ in range(batches):
            client.sample()
        return time.monotonic() - began

    try:
        for kind in args.kinds:
            key = f"torchrl/{kind}"
            before = _ray_pids()
            began = time.monotonic()
            rb = RayReplayBuffer(
                storage=lambda kind=kind: LazyTensorStorage(capacity(kind, args)),
                sampler=lambda kind=kind: PrioritizedSampler(capacity(kind, args), alpha=0.6,
                                                             beta=0.4),
                batch_size=BATCH,
                remote_config={"num_cpus": 0, "resources": NODE_A})
            len(rb)
            out[f"{key}/start_s"] = time.monotonic() - began
            try:
                client = rb.client()
                if "insert" in args.figures:
                    out.update(inserts(key, args, [Writer.options(resources=r).remote(
                        client, kind, args.insert_batch) for r in (NODE_A, NODE_B)]))
                if "stream" not in args.figures:
                    continue
                fill = capacity(kind, args) - len(rb)
                for start in range(0, max(fill, 0), 1024):
                    rb.extend(as_td(rows(kind, min(1024, fill - start))))
                elapsed = ray.get(learn.options(resources=NODE_B).remote(
                    client, batches(kind, args)))
                out[f"{key}/stream_batches_s"] = batches(kind, args) / elapsed
                if kind == ATARI:
                    out[f"{key}/shard_rss_mib"] = [rss_mib(p) for p in _ray_pids() - before
                                                   if "ReplayBuffer" in _title(p)]
            finally:
                rb.close()
    finally:
        ray.shutdown()
        cluster.shutdown()
    return out


def _title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _ray_pids() -> set[int]:
    return {int(p.name) for p in Path("/proc").iterdir()
            if p.name.isdigit() and _title(int(p.name)).startswith("ray::")}


# ------------------------------------------------------------------ both


def _median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
    return statistics.median(values) if values else None


def _ratio(x: float | None, y: float | None) -> str:
    return f"{x / y:.2f}x" if x and y else "-"


def _shown(x: float | None) -> str:
    return f"{x:,.0f}" if x else "-"


def report(results: dict) -> list[str]:
    """The medians of every round, and ours against TorchRL's."""
    lines = [(f"{'figure':<40}{'ours 1 shard':>14}{'ours 2 shards':>15}{'TorchRL':>11}"
              f"{'ratio 1':>9}{'ratio 2':>9}")]
    ours_runs, theirs = results["ours"], results["torchrl"]
    for kind in (SMALL, ATARI):
        for figure, unit in (("insert_rows_s", "rows/s"), ("stream_batches_s", "batches/s")):
            one = _median(ours_runs, f"1-shards/{kind}/{figure}")
            two = _median(ours_runs, f"2-shards/{kind}/{figure}")
            t = _median(theirs, f"torchrl/{kind}/{figure}")
            lines.append(f"{kind + ' ' + figure + ' (' + unit + ')':<40}{_shown(one):>14}"
                         f"{_shown(two):>15}{_shown(t):>11}{_ratio(one, t):>9}"
                         f"{_ratio(two, t):>9}")
    for kind in (SMALL, ATARI):
        starts = [_median(ours_runs, f"{n}-shards/{kind}/start_s") for n in (1, 2)]
        lines.append(f"start, {kind} table (s): ours 1 shard {_seconds(starts[0])}, 2 shards "
                     f"{_seconds(starts[1])}, TorchRL "
                     f"{_seconds(_median(theirs, f'torchrl/{kind}/start_s'))}")
    lines.append("resident memory after the Atari fill (MiB): ours "
                 + str([r.get("1-shards/atari/shard_rss_mib") for r in ours_runs])
                 + ", TorchRL " + str([r.get("torchrl/atari/shard_rss_mib") for r in theirs]))
    lines.append(f"rejoin after a kill (s): serving {_seconds(_median(ours_runs, 'rejoin/serving_s'))}"
                 f", sampled {_seconds(_median(ours_runs, 'rejoin/sampled_s'))}")
    return lines


def _seconds(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=["ours", "torchrl"])
    parser.add_argument("--torchrl-python", default=str(
        HERE.parent / ".venv-torchrl" / "bin" / "python"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--insert-rows", type=int, default=8192, help="per writer")
    parser.add_argument("--insert-batch", type=int, default=64)
    parser.add_argument("--batches", type=int, default=2000, help="small rows' stream")
    parser.add_argument("--atari-batches", type=int, default=200)
    parser.add_argument("--capacity-small", type=int, default=100_000)
    parser.add_argument("--capacity-atari", type=int, default=4096)
    parser.add_argument("--timeout-s", type=float, default=1200)
    parser.add_argument("--kinds", nargs="+", choices=[SMALL, ATARI], default=[SMALL, ATARI])
    parser.add_argument("--figures", nargs="+", choices=["insert", "stream", "rejoin"],
                        default=["insert", "stream", "rejoin"])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.side == "ours":
        print(json.dumps(ours(args)))
        return 0
    if args.side == "torchrl":
        print(json.dumps(torchrl_side(args)))
        return 0
    passed = ["--shards", *map(str, args.shards), "--insert-rows", str(args.insert_rows),
              "--insert-batch", str(args.insert_batch), "--batches", str(args.batches),
              "--atari-batches", str(args.atari_batches),
              "--capacity-small", str(args.capacity_small),
              "--capacity-atari", str(args.capacity_atari), "--kinds", *args.kinds,
              "--figures", *args.figures]
    results: dict = {"ours": [], "torchrl": [], "load_before": os.getloadavg(),
                     "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                    time.gmtime())}
    for round_ in range(args.rounds):
        for side, python in (("ours", sys.executable), ("torchrl", args.torchrl_python)):
            got = run_side([python, __file__, "--side", side, *passed], args.timeout_s)
            print(f"round {round_ + 1} {side}: {json.dumps(got)}", file=sys.stderr)
            if got is not None:
                results[side].append(got)
    results["load_after"] = os.getloadavg()
    lines = report(results)
    print("\n".join(lines))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
