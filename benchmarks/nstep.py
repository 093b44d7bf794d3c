"""n-step benchmark: sampling n-step transitions against plain samples of the same table.

    python benchmarks/nstep.py [--repeat 3] [--seconds 5]

In-process engine, uniform sampler, batch 256, two row kinds: ``atari``
(obs and next.obs 84x84x4 uint8, action, reward, done, episode: 56 KB) and
``small`` (obs and next.obs 17 float32, action, reward, done, episode), 100,000
rows each in episodes of 1,000 steps from 8 interleaved actors. For each kind
the same rows go into a plain table and into tables with ``n_step`` 3 and 10;
the tables take turns (10 slices each per repetition); prints sampled rows/s and the cost ratio plain / n-step (the target: n-step
costs at most 1.5x a plain sample), per repetition, then medians; and the
time the fill's inserts took (1,000 rows each) against the plain table's.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from replay_server.engine.config import TableConfig
from replay_server.engine.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_rates import alternated_rates, arguments, report_medians  # noqa: E402

ROWS = 100_000
ACTORS = 8
EPISODE = 1_000


def rows(kind: str, first: int, n: int) -> dict:
    generator = torch.Generator().manual_seed(first)
    t = torch.arange(first, first + n)
    if kind == "atari":
        obs = torch.randint(0, 255, (n, 84, 84, 4), dtype=torch.uint8, generator=generator)
        nxt = torch.randint(0, 255, (n, 84, 84, 4), dtype=torch.uint8, generator=generator)
    else:
        obs, nxt = torch.randn(n, 17, generator=generator), torch.randn(n, 17, generator=generator)
    episode = (t % ACTORS) * 1_000_000 + (t // ACTORS) // EPISODE
    return {"obs": obs, "next": {"obs": nxt}, "action": torch.zeros(n, dtype=torch.int32),
            "reward": torch.randn(n, generator=generator),
            "done": (t // ACTORS) % EPISODE == EPISODE - 1, "episode": episode}


def main() -> None:
    args = arguments(__doc__)
    runs: dict[str, list[float]] = {}
    for kind in ("atari", "small"):
        tables = {n: Table(TableConfig(name=f"t{n}", capacity=ROWS, seed=0, n_step=n))
                  for n in (1, 3, 10)}
        chunk = 1_000
        filling = dict.fromkeys(tables, 0.0)  # seconds of Table.insert per table
        for first in range(0, ROWS, chunk):
            data = rows(kind, first, chunk)
            for n, table in tables.items():
                start = time.perf_counter()
                table.insert(data)
                filling[n] += time.perf_counter() - start
        for n in (3, 10):  # one fill each: noisier than the sample rates
            print(f"{kind:5} insert: plain {ROWS / filling[1]:>12,.0f} rows/s  n_step={n:<2} "
                  f"{ROWS / filling[n]:>12,.0f} rows/s  cost {filling[n] / filling[1]:.2f}x")
            runs[f"{kind} n_step={n} insert cost vs plain"] = [filling[n] / filling[1]]
        for repetition in range(args.repeat):
            rates = alternated_rates(tables, args.seconds)
            for n in (3, 10):
                cost = rates[1] / rates[n]
                runs.setdefault(f"{kind} n_step={n} cost vs plain", []).append(cost)
                print(f"[{repetition}] {kind:5} plain {rates[1]:>10,.0f} rows/s  n_step={n:<2} "
                      f"{rates[n]:>10,.0f} rows/s  cost {cost:.2f}x", flush=True)
            runs.setdefault(f"{kind} plain rows/s", []).append(rates[1])
        del tables
    report_medians(runs, args.json)


if __name__ == "__main__":
    main()
