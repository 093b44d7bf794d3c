"""A compose actor: plays a random 17-dimensional environment and writes every step.

    python3 actor.py --address server:50051 [--tables replay sequences] [--steps N]

Each step goes to every table named (``replay``: prioritized rows; ``sequences``:
a slice table, which keeps each episode together), one episode of ``--episode-len``
steps after another, through a :class:`replay_client.Writer` per table. ``--steps 0``
runs until stopped (SIGTERM ends it cleanly).
"""

from __future__ import annotations

import argparse
import logging
import signal
import time

import torch

from replay_client import ReplayClient

log = logging.getLogger("actor")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default="127.0.0.1:50051")
    parser.add_argument("--tables", nargs="+", default=["replay", "sequences"])
    parser.add_argument("--steps", type=int, default=0, help="steps in all (0: until stopped)")
    parser.add_argument("--episode-len", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s actor: %(message)s")
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    generator = torch.Generator().manual_seed(args.seed)
    client = ReplayClient(args.address, timeout=None)  # a rate-limited insert waits
    writers = [client.writer(table) for table in args.tables]
    step, started = 0, time.monotonic()
    obs = torch.randn(17, generator=generator)
    try:
        while not stopping and (args.steps == 0 or step < args.steps):
            t = step % args.episode_len
            action = int(torch.randint(4, (1,), generator=generator))
            next_obs = torch.randn(17, generator=generator)
            done = t == args.episode_len - 1 or (args.steps and step == args.steps - 1)
            for writer in writers:
                writer.append({"obs": obs, "action": action, "reward": float(next_obs[0]),
                               "done": bool(done)})
                if done:
                    writer.end_episode()
            obs = next_obs
            step += 1
            if step % 10_000 == 0:
                log.info("%d steps (%.0f steps/s)", step, step / (time.monotonic() - started))
    finally:
        for writer in writers:
            writer.close()
        client.close()
    log.info("stopped after %d steps", step)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
