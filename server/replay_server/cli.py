"""The ``replay-server`` command.

``replay-server serve`` builds the server's tables and keeps them until
SIGINT/SIGTERM. The gRPC service (and with it ``--config``, ``health``,
``info`` and ``checkpoint``) arrives with the network-service issue; until then
``serve`` hosts the engine alone and says so.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from replay_server.config import default_table_configs
from replay_server.tables import Tables

log = logging.getLogger("replay_server")


def _serve(args: argparse.Namespace) -> int:
    tables = Tables(default_table_configs(capacity=args.capacity))
    log.info("no config given: serving the default tables (one per sampler kind)")
    for table in tables:
        config = table.config
        extra = f", slice_len={config.slice_len}" if config.slice_len else ""
        log.info("table %r: sampler=%s capacity=%d%s", config.name, config.sampler.value,
                 config.capacity, extra)
    log.warning(
        "the network service is not built yet: these tables live in this process only and "
        "cannot be reached over gRPC (see README, 'Status')"
    )
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    log.info("ready; stop with Ctrl-C or SIGTERM")
    stop.wait()
    log.info("stopped")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="replay-server", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="start a server with the default tables")
    serve.add_argument("--capacity", type=int, default=100_000,
                       help="rows per default table (default: 100000)")
    serve.set_defaults(run=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    args = build_parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
