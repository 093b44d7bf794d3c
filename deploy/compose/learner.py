"""A compose learner: streams prioritized batches and sends new priorities back.

    python3 learner.py --address server:50051 [--table replay] [--batches N]

Stands in for a real learner's update: each batch's "TD errors" are random, and
go back as the rows' new priorities without waiting (``wait=False``). Prints the
transport (``shared_memory`` when it shares the server's ``/dev/shm`` and its
batches are large; small batches come grouped over ``grpc``) and the rate. ``--batches 0`` runs until stopped (SIGTERM ends it cleanly).
"""

from __future__ import annotations

import argparse
import logging
import signal
import time

import torch

from replay_client import ReplayClient

log = logging.getLogger("learner")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default="127.0.0.1:50051")
    parser.add_argument("--table", default="replay")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--batches", type=int, default=0, help="batches in all (0: until stopped)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s learner: %(message)s")
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    client = ReplayClient(args.address, timeout=None)
    taken, started = 0, time.monotonic()
    with client.stream(args.table, args.batch_size, prefetch=4) as stream:
        for batch in stream:
            td_errors = torch.rand(len(batch.ids)) + 1e-3
            client.update_priorities(args.table, batch.ids, td_errors, wait=False)
            taken += 1
            if taken == 1:
                log.info("first batch via %s", stream.transport)
            if taken % 1000 == 0:
                log.info("%d batches (%.0f batches/s)", taken, taken / (time.monotonic() - started))
            if stopping or taken == args.batches:
                break
    client.flush_updates()
    client.close()
    log.info("stopped after %d batches (%s)", taken, stream.transport)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
