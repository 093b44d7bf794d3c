"""``python -m examples.dqn_cartpole``: server, actors and learner; a progress bar and a plot.

Starts ``replay-server`` in its own process with one prioritized table
(rate-limited to ``--samples-per-insert`` sampled rows per inserted row),
``--actors`` actor processes (:mod:`examples.dqn_cartpole.actor`) and the
learner in this process (:mod:`examples.dqn_cartpole.learner`). It prints a
progress line (env steps, steps/s, the last 20 training returns, the last
greedy evaluation, table fill, updates), evaluates the greedy policy on 20
episodes every ``--eval-every-s`` seconds, stops when an evaluation reaches
``--target`` (or at ``--max-seconds`` / ``--max-env-steps``), saves a plot of
return against environment steps and, with ``--summary``, a JSON summary.
Exit status 0 when everything ran without error (reaching the target is
reported, not required).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from examples.dqn_cartpole.actor import run_actor
from examples.dqn_cartpole.learner import Learner, evaluate
from examples.dqn_cartpole.model import GAMMA, N_STEP
from replay_client import ReplayClient, errors

TABLE = """
[[tables]]
name = "replay"
capacity = {capacity}
sampler = "prioritized"
alpha = 0.6
beta = 0.4
n_step = {n_step}
gamma = {gamma}
min_size_to_sample = {min_size}
samples_per_insert = {spi}
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m examples.dqn_cartpole", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--actors", type=int, default=2)
    p.add_argument("--envs-per-actor", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--samples-per-insert", type=float, default=64.0,
                   help="sampled rows per inserted row (the table's rate limiter)")
    p.add_argument("--capacity", type=int, default=100_000)
    p.add_argument("--min-size", type=int, default=1000, help="rows before learning starts")
    p.add_argument("--epsilon-steps", type=int, default=15_000,
                   help="env steps (all actors) over which exploration decays to 0.05")
    p.add_argument("--target", type=float, default=475.0)
    p.add_argument("--eval-every-s", type=float, default=10.0)
    p.add_argument("--max-seconds", type=float, default=600.0)
    p.add_argument("--max-env-steps", type=int, default=0, help="0: no limit")
    p.add_argument("--plot", type=Path, default=Path("dqn_cartpole.png"))
    p.add_argument("--summary", type=Path, default=None, help="write a JSON summary here")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def start_server(args: argparse.Namespace, workdir: Path) -> tuple[subprocess.Popen, str]:
    config = workdir / "server.toml"
    config.write_text(TABLE.format(capacity=args.capacity, min_size=args.min_size,
                                   spi=args.samples_per_insert, n_step=N_STEP, gamma=GAMMA))
    port_file = workdir / "server.port"
    log = (workdir / "server.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "replay_server.app.cli", "serve", "--config", str(config),
         "--address", "127.0.0.1:0", "--port-file", str(port_file)],
        stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not (port_file.exists() and port_file.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the server did not start:\n{(workdir / 'server.log').read_text()}")
        time.sleep(0.05)
    return proc, f"127.0.0.1:{int(port_file.read_text())}"


class Progress:
    """One status line: redrawn in place on a terminal, printed every few seconds otherwise."""

    def __init__(self, total_s: float) -> None:
        self.total_s = total_s
        self.start = time.monotonic()
        self.tty = sys.stdout.isatty()
        self._last = 0.0

    def show(self, steps: int, returns: list[float], evaluation: float | None, fill: float,
             updates: int, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < (0.5 if self.tty else 5.0):
            return
        self._last = now
        elapsed = now - self.start
        done = min(1.0, elapsed / self.total_s)
        bar = "#" * int(20 * done) + "-" * (20 - int(20 * done))
        recent = sum(returns[-20:]) / len(returns[-20:]) if returns else 0.0
        line = (f"[{bar}] {elapsed:5.0f}s | {steps:>8,} env steps | {steps / max(elapsed, 1e-9):6,.0f}"
                f" steps/s | return {recent:5.1f} | eval "
                f"{'  -  ' if evaluation is None else f'{evaluation:5.1f}'} | table {fill:4.0%} | "
                f"{updates:,} updates")
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", flush=True)


def save_plot(path: Path, episodes: list[tuple[int, float]], evals: list[tuple[int, float]],
              target: float, reached: tuple[float, int] | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    if episodes:
        xs, ys = zip(*episodes)
        ax.plot(xs, ys, ".", ms=2, alpha=0.3, color="tab:blue", label="training episode return")
        window = [sum(ys[max(0, i - 19): i + 1]) / len(ys[max(0, i - 19): i + 1])
                  for i in range(len(ys))]
        ax.plot(xs, window, color="tab:blue", label="training return, last 20 episodes")
    if evals:
        ex, ey = zip(*evals)
        ax.plot(ex, ey, "o-", color="tab:red", label="greedy evaluation (20 episodes)")
    ax.axhline(target, ls="--", color="gray", lw=1)
    title = "DQN on CartPole-v1 through replay-server"
    if reached is not None:
        title += f": {target:.0f} reached after {reached[0]:.0f} s, {reached[1]:,} env steps"
    ax.set(title=title, xlabel="environment steps", ylabel="return", ylim=(0, 520))
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    start = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="dqn_cartpole-"))
    server, address = start_server(args, workdir)
    ctx = multiprocessing.get_context("spawn")
    report: multiprocessing.Queue = ctx.Queue()
    stop = ctx.Event()
    client = ReplayClient(address, timeout=60)
    learner = Learner(client)  # publishes version 1 before any actor starts
    actors = [ctx.Process(target=run_actor, args=(i, address, report, stop),
                          kwargs={"envs": args.envs_per_actor, "seed": args.seed * 100 + i + 1,
                                  "epsilon_steps": args.epsilon_steps // args.actors},
                          name=f"actor-{i}", daemon=True)
              for i in range(args.actors)]
    for proc in actors:
        proc.start()
    progress = Progress(args.max_seconds)
    actor_steps = [0] * args.actors
    finished: dict[int, tuple[list[int], str]] = {}
    ready: set[int] = set()  # actors that loaded the first weights
    episodes: list[tuple[int, float]] = []
    evals: list[tuple[int, float]] = []
    reached: tuple[float, int] | None = None
    next_eval = time.monotonic() + args.eval_every_s
    stream = client.stream("replay", args.batch_size, prefetch=4, wait_timeout=60)
    error = ""

    def drain() -> None:
        while True:
            try:
                kind, index, steps, *rest = report.get_nowait()
            except queue.Empty:
                return
            actor_steps[index] = max(actor_steps[index], steps)
            if kind == "episode":
                episodes.append((sum(actor_steps), rest[0]))
            elif kind == "actor_done":
                finished[index] = (rest[0], rest[1])
            elif kind == "ready":
                ready.add(index)

    try:
        for batch in stream:
            learner.update(batch)
            drain()
            steps = sum(actor_steps)
            out_of_budget = time.monotonic() - start > args.max_seconds or (
                args.max_env_steps and steps >= args.max_env_steps and len(ready) == args.actors)
            if time.monotonic() >= next_eval or out_of_budget:
                score = evaluate(learner.net)
                evals.append((steps, score))
                next_eval = time.monotonic() + args.eval_every_s
                if score >= args.target:
                    reached = (time.monotonic() - start, steps)
            if reached is not None or out_of_budget or finished:
                break
            if learner.updates % 50 == 0:
                info = client.info()["replay"]
                progress.show(steps, [r for _, r in episodes], evals[-1][1] if evals else None,
                              info.size / info.capacity, learner.updates)
    except errors.DeadlineExceededError as exc:
        error = f"the learner's stream timed out (did the actors stop?): {exc}"
    except KeyboardInterrupt:
        error = "interrupted"
    finally:
        # Learner first, then the server (waiting inserts end at once), then the actors.
        stream.close()
        stop.set()
        client.flush_updates()
        info = client.info()["replay"]
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
        for proc in actors:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()
        drain()
    progress.show(sum(actor_steps), [r for _, r in episodes], evals[-1][1] if evals else None,
                  info.size / info.capacity, learner.updates, force=True)
    print()
    save_plot(args.plot, episodes, evals, args.target, reached)
    actor_errors = [e for _, e in finished.values() if e]
    summary = {
        "address": address, "seconds": time.monotonic() - start,
        "env_steps": sum(actor_steps), "updates": learner.updates,
        "published_version": learner.version, "inserted": info.counters["inserted"],
        "priority_updates": info.counters["priority_updates"],
        "episodes": len(episodes), "evaluations": evals,
        "reached_target": None if reached is None else {"seconds": reached[0],
                                                        "env_steps": reached[1]},
        "actors": {str(i): {"versions_loaded": v, "error": e}
                   for i, (v, e) in sorted(finished.items())},
        "errors": [e for e in [error, *actor_errors] if e],
        "plot": str(args.plot), "cpu_count": os.cpu_count(),
    }
    if args.summary is not None:
        args.summary.write_text(json.dumps(summary, indent=1))
    if reached is not None:
        print(f"reached an average greedy return of {args.target:.0f} over 20 episodes after "
              f"{reached[0]:.0f} s and {reached[1]:,} environment steps; plot: {args.plot}")
    else:
        best = max((s for _, s in evals), default=float("nan"))
        print(f"stopped after {summary['seconds']:.0f} s without reaching {args.target:.0f} "
              f"(best evaluation {best:.1f}); plot: {args.plot}")
    for message in summary["errors"]:
        print(f"error: {message}", file=sys.stderr)
    missing = [i for i in range(args.actors) if i not in finished]
    if missing:
        print(f"error: actors {missing} did not report back", file=sys.stderr)
    return 1 if summary["errors"] or missing else 0


if __name__ == "__main__":
    sys.exit(main())
