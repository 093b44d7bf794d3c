"""Frame-stack dedup benchmark: memory per Atari transition and sample throughput, against
the same table storing the full stacks (today's way).

    python benchmarks/framestack.py [--repeat 3] [--seconds 5]

In-process engine, uniform sampler, batch 256. An Atari transition: ``obs``
and ``next.obs`` ``[4, 84, 84]`` uint8, ``action`` int64, ``reward`` float32,
``done`` bool, ``episode`` int64; 8 actors interleave episodes of 500 steps
(frame stacks padded by repeating the first frame). The same 50,000
transitions go into a plain table and into one with ``frame_stack_key =
"obs"``. Prints bytes per transition (the table's storage plus the sampler's
per-slot state, over its capacity), the memory ratio, sampled rows/s and
the throughput ratio dedup / plain (the tables take turns, 10 slices each per
repetition), per repetition, then medians.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from replay_server.engine.config import TableConfig
from replay_server.engine.table_memory import table_bytes
from replay_server.engine.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_rates import alternated_rates, arguments, BATCH, report_medians  # noqa: E402

ROWS = 50_000
ACTORS = 8
EPISODE = 500
STACK = 4


def transitions(n: int) -> dict:
    """``n`` interleaved steps of ACTORS actors, stacked as a frame-stack wrapper would."""
    generator = torch.Generator().manual_seed(0)
    t = torch.arange(n)
    actor, step = t % ACTORS, t // ACTORS
    episode = actor * 100_000 + step // EPISODE
    frames = torch.randint(0, 255, (n + ACTORS, 84, 84), dtype=torch.uint8, generator=generator)
    obs = torch.empty((n, STACK, 84, 84), dtype=torch.uint8)
    nxt = torch.empty_like(obs)
    for k in range(STACK):  # frame of step s - (STACK - 1 - k), repeated before the episode's start
        back = torch.clamp(step % EPISODE - (STACK - 1 - k), min=0) - step % EPISODE
        obs[:, k] = frames[t + back * ACTORS]
    nxt[:, :-1] = obs[:, 1:]
    nxt[:, -1] = frames[t + ACTORS]  # the next step's frame
    return {"obs": obs, "next": {"obs": nxt}, "action": torch.zeros(n, dtype=torch.int64),
            "reward": torch.randn(n, generator=generator),
            "done": step % EPISODE == EPISODE - 1, "episode": episode}


def main() -> None:
    args = arguments(__doc__)
    data = transitions(ROWS)
    tables = {name: Table(TableConfig(name=name, capacity=ROWS, seed=0, **extra))
              for name, extra in (("plain", {}), ("dedup", {"frame_stack_key": "obs"}))}
    for first in range(0, ROWS, 1_000):
        chunk = {k: v[first:first + 1_000] for k, v in data.items() if k != "next"}
        chunk["next"] = {"obs": data["next"]["obs"][first:first + 1_000]}
        for table in tables.values():
            table.insert(chunk)
    per_row = {name: table_bytes(t.config, t.schema) / ROWS for name, t in tables.items()}
    a, b = tables["plain"].sample(BATCH), tables["dedup"].sample(BATCH)
    assert torch.equal(a.data["obs"], b.data["obs"]) and torch.equal(a.data["next"]["obs"],
                                                                      b.data["next"]["obs"])
    print(f"bytes per transition: plain {per_row['plain']:,.0f}, dedup {per_row['dedup']:,.0f}: "
          f"{per_row['plain'] / per_row['dedup']:.2f}x less; kept histories: "
          f"{tables['dedup'].info().sampler_stats['frame_history_rows']}")
    ratios, plain_rates = [], []
    for repetition in range(args.repeat):
        rates = alternated_rates(tables, args.seconds)
        plain, dedup = rates["plain"], rates["dedup"]
        ratios.append(dedup / plain)
        plain_rates.append(plain)
        print(f"[{repetition}] plain {plain:>10,.0f} rows/s  dedup {dedup:>10,.0f} rows/s  "
              f"{dedup / plain:.2f}x", flush=True)
    report_medians({"memory_ratio": [per_row["plain"] / per_row["dedup"]],
                    "plain_bytes_per_row": [per_row["plain"]],
                    "dedup_bytes_per_row": [per_row["dedup"]], "throughput_ratio": ratios,
                    "plain_rows_per_s": plain_rates}, args.json)


if __name__ == "__main__":
    main()
