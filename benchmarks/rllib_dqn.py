"""RLlib DQN's environment steps per second: its own buffer against ``ShardedEpisodeReplayBuffer``.

    python benchmarks/rllib_dqn.py --json results/rllib_dqn.json

One config, two buffers: DQN (RLlib's new API stack) on CartPole, the
environment, the learner and the buffer's ``add``/``sample`` in the
algorithm's process (``num_env_runners=0``, ``num_learners=0``), one update
of ``--train-batch`` rows per ``--fragment`` environment steps, prioritized
replay (alpha 0.6, beta 0.4, capacity ``--capacity`` rows, 1-step returns),
on a local Ray cluster of two nodes of one CPU each on 127.0.0.1 (as
``benchmarks/ray_buffers.py`` starts it). The sides:

* ``rllib``: ``replay_buffer_config["type"] = "PrioritizedEpisodeReplayBuffer"``
  (RLlib's own, in the algorithm's process);
* ``shards``: ``"replay_server.ray.rllib.ShardedEpisodeReplayBuffer"`` with
  ``--num-shards`` shards (one per node, taking no CPU), as configured by
  default: every ``add`` an insert into the shards sent in the background,
  samples from its learner stream over them (``prefetch`` 2), priority
  updates riding on that stream;
* ``shards-calls`` (only if ``--sides`` names it): the same with
  ``"prefetch": 0, "pending_adds": 0``: every add, sample and update a call
  the training step waits for;
* ``shards-direct`` (only if ``--sides`` names it; needs ``--env-runners``
  >= 1): ``shards`` with ``env_runner_cls=ShardedEnvRunner``: each remote
  env runner inserts its samples into the shards itself and hands the
  driver only counts, so the driver's ``add`` sends nothing.

``--env-runners N`` (default 0) gives every side N remote env runners (one
CPU each), so the sides differ in the buffer alone; with 0 the environment
steps in the algorithm's process.

Each side runs in its own process, the sides alternating for ``--rounds``
rounds; per round it builds the algorithm, trains ``--warmup`` iterations
untimed (past ``num_steps_sampled_before_learning_starts``, so every timed
step trains), then ``--iterations`` iterations of at least ``--steps``
environment steps each, timed. The figure: environment steps sampled during
the timed iterations per second of them (RLlib's
``num_env_steps_sampled_lifetime``), and the rows the learner trained on in
them (both sides must train alike for the figure to compare buffers), with
RLlib's own timers of a training step's parts (the buffer's add, sample and
priority update, the learner's update; its smoothed means, in ms).
The ratio is of the medians. Run ``--side rllib`` or ``--side shards`` for one
side once (it prints one JSON line).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # nodes on 127.0.0.1
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

HERE = Path(__file__).resolve().parent
# lz4 (imported by RLlib, through fsspec) looks for a module named compression first, and would
# find benchmarks/compression.py: import it with this folder off the path, then put the folder first.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
import lz4.frame  # noqa: E402, F401

sys.path.insert(0, str(HERE))

from ray_buffers import NODE_A, NODE_B, start_cluster
from sides import run_side

# Off the path again: Ray gives its workers the driver's script folder when it is on sys.path,
# and an env runner's RLlib would import benchmarks/compression.py for lz4's (--env-runners).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # ray_buffers adds it too

SHARDED = "replay_server.ray.rllib.ShardedEpisodeReplayBuffer"
SIDES = ("rllib", "shards", "shards-calls", "shards-direct")
TIMERS = ("replay_buffer_add_data_timer", "replay_buffer_sampling_timer",
          "replay_buffer_update_prios_timer", "learner_update_timer", "training_step")
"""RLlib's timers of one training step's parts (its smoothed seconds), kept in the JSON."""


def buffer_config(side: str, args) -> dict:
    """The ``replay_buffer_config`` of ``side``: the same capacity, alpha and beta on both."""
    common = {"capacity": args.capacity, "alpha": 0.6, "beta": 0.4}
    if side == "rllib":
        return {"type": "PrioritizedEpisodeReplayBuffer", **common}
    return {"type": SHARDED, **common, "replay": "bench-dqn", "num_shards": args.num_shards,
            "n_step": 1, "checkpoint_interval_s": 0,
            **({"prefetch": 0, "pending_adds": 0} if side == "shards-calls" else {}),
            "shard_options": [{"num_cpus": 0, "resources": r}
                              for r in (NODE_A, NODE_B)][:args.num_shards]}


def env_runners(side: str, args) -> dict:
    """The ``config.env_runners`` keywords of ``side``: ``--env-runners`` remote ones (the
    ``ShardedEnvRunner`` for ``shards-direct``)."""
    runners: dict = {"num_env_runners": args.env_runners,
                     "rollout_fragment_length": args.fragment}
    if side == "shards-direct":
        if args.env_runners < 1:
            raise SystemExit("shards-direct needs --env-runners >= 1 (remote env runners)")
        from replay_server.ray.rllib_env_runner import ShardedEnvRunner

        runners["env_runner_cls"] = ShardedEnvRunner
    return runners


def algorithm(side: str, args):
    from ray.rllib.algorithms.dqn import DQNConfig

    return (DQNConfig()
            .environment("CartPole-v1")
            .framework("torch")
            .env_runners(**env_runners(side, args))
            .learners(num_learners=0)
            .debugging(seed=0)
            .reporting(min_sample_timesteps_per_iteration=args.steps,
                       min_time_s_per_iteration=0)
            .training(train_batch_size_per_learner=args.train_batch, lr=5e-4, n_step=1,
                      num_steps_sampled_before_learning_starts=args.learning_starts,
                      target_network_update_freq=500,
                      replay_buffer_config=buffer_config(side, args))
            .build_algo())


def one_side(side: str, args) -> dict:
    import ray

    cluster, _ = start_cluster()
    out: dict = {"side": side}
    try:
        algo = algorithm(side, args)
        try:
            for _ in range(args.warmup):
                result = algo.train()
            steps0 = result["env_runners"]["num_env_steps_sampled_lifetime"]
            trained0 = _trained(result)
            began = time.monotonic()
            for _ in range(args.iterations):
                result = algo.train()
            elapsed = time.monotonic() - began
            steps = result["env_runners"]["num_env_steps_sampled_lifetime"] - steps0
            buffer = algo.local_replay_buffer
            if side.startswith("shards"):  # the rows the driver's add sent itself
                out["rows_sent_by_driver"] = buffer.rows_sent
            out.update({"env_steps_s": steps / elapsed, "env_steps": steps,
                        "rows_trained": _trained(result) - trained0, "seconds": elapsed,
                        "timers_ms": {name: 1000 * float(value) for name, value in
                                      result.get("timers", {}).items()
                                      if name in TIMERS and isinstance(value, (int, float))}})
        finally:
            algo.stop()
            if side.startswith("shards"):
                from replay_server.ray import ReplayCluster

                ReplayCluster.get("bench-dqn").shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()
    return out


def _trained(result: dict) -> int:
    """Rows the learner has trained on so far (RLlib's lifetime count; -1: not reported)."""
    learners = result.get("learners", {}).get("__all_modules__", {})
    return int(learners.get("num_env_steps_trained_lifetime", -1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=SIDES)
    parser.add_argument("--sides", default="shards,rllib",
                        help=f"the sides to run, alternating, from {', '.join(SIDES)}")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-shards", type=int, default=2)
    parser.add_argument("--env-runners", type=int, default=0,
                        help="remote env runners of every side (shards-direct needs >= 1)")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--steps", type=int, default=500, help="env steps per iteration")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--fragment", type=int, default=4)
    parser.add_argument("--train-batch", type=int, default=32)
    parser.add_argument("--learning-starts", type=int, default=100)
    parser.add_argument("--capacity", type=int, default=20_000)
    parser.add_argument("--timeout-s", type=float, default=900)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.side is not None:
        print(json.dumps(one_side(args.side, args)))
        return 0
    passed = ["--num-shards", str(args.num_shards), "--env-runners", str(args.env_runners),
              "--iterations", str(args.iterations),
              "--steps", str(args.steps), "--warmup", str(args.warmup),
              "--fragment", str(args.fragment), "--train-batch", str(args.train_batch),
              "--learning-starts", str(args.learning_starts), "--capacity", str(args.capacity)]
    sides = args.sides.split(",")
    results: dict = {**{side: [] for side in sides}, "load_before": os.getloadavg(),
                     "cores": os.cpu_count(),
                     "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    for round_ in range(args.rounds):
        for side in (sides if round_ % 2 == 0 else sides[::-1]):
            got = run_side([sys.executable, __file__, "--side", side, *passed], args.timeout_s)
            print(f"round {round_ + 1} {side}: {json.dumps(got)}", file=sys.stderr)
            if got is not None:
                results[side].append(got)
    results["load_after"] = os.getloadavg()
    medians = {side: statistics.median(r["env_steps_s"] for r in results[side])
               for side in sides if results[side]}
    for side, value in medians.items():
        print(f"{side:<13} env steps/s {value:,.0f} (rounds: "
              f"{[round(r['env_steps_s']) for r in results[side]]})")
    for side in medians:
        if side != "rllib" and "rllib" in medians:
            print(f"{side} / rllib: {medians[side] / medians['rllib']:.2f}x")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
