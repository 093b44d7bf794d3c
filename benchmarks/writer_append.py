"""The actor's side of ``Writer.append`` alone: CPU time per step, no server.

    python benchmarks/writer_append.py --kinds atari,small

The writer sends to an inserter that stores nothing, so what is measured is the
calling thread's CPU time (``time.thread_time``: robust to other load on the
machine) to append the rows of ``benchmarks/service.py --cases insert`` one step
at a time (a dict of tensors per step, as an actor has them), with and without
episode ids (an episode ends every 500 steps). Best of ``--repeats``. The end to
end figure, with a server and the background inserts, is ``service.py``'s
"Writer.append (per step)" row.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import service_workload as w  # noqa: E402


class _Nowhere:
    def insert(self, table, data):
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default=",".join(w.ROW_KINDS))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch

    from replay_client import Writer

    torch.set_num_threads(1)
    for kind in args.kinds.split(","):
        n = w.INSERT_ROWS[kind]
        rows = {k: torch.from_numpy(v) for k, v in w.make_rows(kind, 0, n).items()}
        steps = [{k: v[i] for k, v in rows.items()} for i in range(n)]
        for episode_key in (None, "episode"):
            best = float("inf")
            for _ in range(args.repeats):
                writer = Writer(_Nowhere(), kind, batch_rows=256, episode_key=episode_key)
                start = time.thread_time()
                for i, step in enumerate(steps):
                    writer.append(step)
                    if episode_key and i % 500 == 499:
                        writer.end_episode()
                writer.close()
                best = min(best, (time.thread_time() - start) / n)
            print(f"{kind} episode_key={episode_key}: {best * 1e6:.2f} us/step "
                  f"({1 / best:,.0f} steps/s of the caller's CPU)")


if __name__ == "__main__":
    main()
