"""Where an engine call's time goes, piece by piece (our side only, in one process).

    python benchmarks/profile_engine.py prioritized --rows 1000000 --batch 256
    python benchmarks/profile_engine.py atari-insert --capacity 50000

``prioritized``: a table of the engine benchmark's rows; then the median time
of ``Table.sample`` and ``Table.update_priorities`` and of their parts (the
sampler's draw, the tree search, the row gather, the tree update, the input
checks), each with fresh random draws as the real call has. ``atari-insert``:
decoding an Insert of 256 Atari rows (7.2 MB) and ``Table.insert`` into a
table still filling, 5 ms apart (the idle time a network transfer leaves).
Prints one line per piece; figures are medians over repeated calls.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import workload as w  # noqa: E402


def _median_us(fn, calls: int) -> float:
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def prioritized(rows: int, batch: int, calls: int) -> None:
    from replay_server import Table, TableConfig
    from replay_server.engine.inputs import id_values, priority_values

    table = Table(TableConfig(name="b", capacity=rows, sampler="prioritized",
                              alpha=w.ALPHA, beta=w.BETA, seed=0))
    for start in range(0, rows, w.FILL_CHUNK):
        table.insert(w.make_rows(start, min(w.FILL_CHUNK, rows - start)))
    parts = table._parts  # the table's own pieces, read for timing only
    sampler, tree, generator = parts.sampler, parts.sampler._tree, parts.generator
    sample = table.sample(batch)
    priorities = w.new_priorities(batch, seed=1)
    slots = np.asarray(sample.ids) % rows
    mass = sampler._prio.mass(np.asarray(priorities, dtype=np.float64))
    fresh = iter([np.random.default_rng(i).integers(0, rows, batch) for i in range(3 * calls)])
    pieces = {
        "Table.sample": lambda: table.sample(batch),
        "  sampler draw (search, probabilities, weights, ids)": lambda: sampler.sample(batch, generator),
        "    tree search of fresh targets": lambda: tree.find(generator.random(batch) * tree.total()),
        "  gather of fresh rows, all columns": lambda: parts.storage.gather(next(fresh)),
        "Table.update_priorities": lambda: table.update_priorities(sample.ids, priorities),
        "  checks and conversions of ids": lambda: id_values(sample.ids, "b"),
        "  checks and conversions of priorities": lambda: priority_values(priorities, "b", w.ALPHA),
        "  tree update": lambda: tree.set(slots, mass),
    }
    for name, fn in pieces.items():
        print(f"{name:55s} {_median_us(fn, calls):9.1f} us")


def atari_insert(capacity: int, calls: int) -> None:
    import service_workload as sw

    from replay_proto import messages
    from replay_proto.codec import frame
    from replay_server import Table, TableConfig

    rows = {k: torch.from_numpy(v) for k, v in sw.make_rows("atari", 0, 256).items()}
    raw = frame(*messages.insert_parts("atari", rows))
    table = Table(TableConfig(name="atari", capacity=capacity, sampler="prioritized"))
    decode, insert = [], []
    for _ in range(calls):
        start = time.perf_counter()
        call = messages.decode_insert(raw)
        middle = time.perf_counter()
        table.insert(call.columns, call.priorities)
        decode.append(middle - start)
        insert.append(time.perf_counter() - middle)
        time.sleep(0.005)
    print(f"encode (client, 7.2 MB)  {_median_us(lambda: frame(*messages.insert_parts('atari', rows)), 20):9.1f} us")
    print(f"decode (server)          {statistics.median(decode) * 1e6:9.1f} us")
    print(f"Table.insert             {statistics.median(insert) * 1e6:9.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["prioritized", "atari-insert"])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--capacity", type=int, default=50_000)
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args()
    if args.what == "prioritized":
        prioritized(args.rows, args.batch, args.calls)
    else:
        atari_insert(args.capacity, min(args.calls, 60))


if __name__ == "__main__":
    main()
