"""The ``replay-server`` command.

    replay-server serve [--config FILE] [--address HOST:PORT] [--checkpoint-dir DIR]
                        [--log-level LEVEL] [--port-file PATH] [--start-empty-if-unrestorable]
    replay-server check-config FILE
    replay-server health     [--address HOST:PORT] [TLS flags]
    replay-server info       [--address HOST:PORT] [--json] [TLS flags]
    replay-server checkpoint [--address HOST:PORT] [TLS flags]
    replay-server reset TABLE [--schema] [--address HOST:PORT] [TLS flags]
    replay-server --version

``serve`` with no config listens on 127.0.0.1:50051 with the default tables
(one per sampler kind) and says so; without a checkpoint directory it warns
that rows are lost at stop. ``check-config`` validates a config file the way
``serve`` would, without starting. The operator's commands
(:mod:`replay_server.app.commands`) talk to 127.0.0.1:50051 unless
``--address`` says otherwise (a missing port is 50051; TLS and token flags:
:mod:`replay_server.app.channel`).

Only ``serve`` loads the engine's tables (and torch): this module imports
nothing heavy at the top, so ``--version`` and the operator's commands start
in a fraction of a second, and ``check-config`` reads the config's torch-free
declarations (:mod:`replay_server.engine.sampler_kinds` and its siblings),
neither torch nor grpc. Every error goes to stderr as one
line, ``replay-server: error: ...`` (``configuration error`` for a bad
config). Exit status: 0 done, 1 the server refused or could not be reached
(``health``: not SERVING), 2 a usage or configuration error.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from importlib import metadata
from pathlib import Path

from replay_proto.addresses import AddressError, with_port
from replay_server.app.channel import add_channel_flags
from replay_server.errors import ConfigError, InsufficientMemoryError, RestoreError

LOG_LEVELS = ("debug", "info", "warning", "error")

_DESCRIPTION = "A replay memory for reinforcement learning, served over gRPC."

_EPILOG = """\
`replay-server COMMAND --help` says more about each command. Examples:
  replay-server serve --config replay.toml
  replay-server check-config replay.toml
  replay-server info --address 10.0.0.5:50051
  replay-server reset replay --schema"""


def _serve(args: argparse.Namespace) -> int:
    # A malformed --address is refused before torch is loaded (a usage error in a fraction of
    # a second, not after the engine's imports).
    address = _address(args.address, "--address") if args.address else None
    import dataclasses
    import logging

    from replay_server.app import logs
    from replay_server.app.config_file import load_settings
    from replay_server.app.heap import keep_request_buffers
    from replay_server.service.loop import run
    from replay_server.service.server import ReplayServer
    from replay_server.service.settings import ServerSettings

    level = getattr(logging, args.log_level.upper())
    logs.configure(level=level)
    log = logging.getLogger("replay_server")
    settings = load_settings(args.config) if args.config else ServerSettings()
    if address:
        settings = dataclasses.replace(settings, address=address)
    if args.start_empty_if_unrestorable:
        settings = dataclasses.replace(settings, start_empty_if_unrestorable=True)
    if args.checkpoint_dir:
        settings = dataclasses.replace(settings, checkpoint_dir=args.checkpoint_dir)
    logs.configure(settings.log_format, level)
    keep_request_buffers()  # after the logs: it says so when glibc refuses
    if not args.config:
        log.info("no config given: serving the default tables (one per sampler kind)")
    if settings.checkpoint_dir is None:
        log.warning("no checkpoint_dir: every row is lost when this server stops; set "
                    "server.checkpoint_dir (or --checkpoint-dir) to keep them")
    for table in settings.tables:
        extra = f", slice_len={table.slice_len}" if table.slice_len else ""
        log.info("table %r: sampler=%s capacity=%d%s", table.name, table.sampler.value,
                 table.capacity, extra)
    server = ReplayServer(settings)
    run(server.serve(port_file=Path(args.port_file) if args.port_file else None,
                     grace=args.grace))
    return server.exit_code


def _check_config(args: argparse.Namespace) -> int:
    from replay_server.app.config_file import load_settings
    from replay_server.app.config_report import config_report
    from replay_server.service.tls_files import tls_files

    settings = load_settings(args.file)
    tls_files(settings)  # TLS files read and checked as serve reads them
    report = config_report(settings)
    print(f"{args.file}: valid\n{report}")
    return 0


def _operator(name: str):
    """The operator's command ``name`` (imported when it runs: grpc, never torch)."""

    def run(args: argparse.Namespace) -> int:
        from replay_server.app import commands

        args.address = _address(args.address, "--address")
        try:
            return getattr(commands, name)(args)
        except commands.CommandError as exc:  # exit 1: the server refused, or is not there
            commands.print_error(str(exc))
            return 1

    return run


def _address(address: str, flag: str) -> str:
    """``address`` with the default port where it names none (never gRPC's 443)."""
    try:
        return with_port(address)
    except AddressError as exc:
        raise ConfigError(f"{flag}: {exc}") from None


def build_parser() -> argparse.ArgumentParser:
    """The command line; no parser takes abbreviations (``--port`` is never ``--port-file``)."""
    parser = argparse.ArgumentParser(
        prog="replay-server", description=_DESCRIPTION, epilog=_EPILOG, allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"replay-server {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     title="commands")

    def command(name: str, text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=text, description=text, allow_abbrev=False)
        sub.set_defaults(parser=sub)
        return sub

    serve = command("serve", "run a server (default tables on 127.0.0.1:50051, or --config "
                             "FILE)")
    serve.add_argument("--config", metavar="FILE",
                       help="TOML config file (default: the built-in tables)")
    serve.add_argument("--address", metavar="HOST:PORT",
                       help="override server.address (port 0: any free port)")
    serve.add_argument("--checkpoint-dir", metavar="DIR",
                       help="override server.checkpoint_dir (restored at start, written at stop)")
    serve.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                       help="the least severe log records shown (default info)")
    serve.add_argument("--port-file", metavar="PATH",
                       help="write the bound port to this file once serving")
    serve.add_argument("--grace", type=float, default=10.0, metavar="SECONDS",
                       help="seconds in-flight calls get to finish at shutdown (default 10)")
    serve.add_argument("--start-empty-if-unrestorable", action="store_true",
                       help="start with empty tables when checkpoints exist but none can be "
                            "restored (default: refuse to start); the checkpoints are kept")
    serve.set_defaults(run=_serve)

    check = command("check-config", "validate a config file without starting a server")
    check.add_argument("file", metavar="FILE", help="the TOML config file")
    check.set_defaults(run=_check_config)

    for name, text, timeout in (
        ("health", "is a server SERVING? (exit 0 when it is)", 5.0),
        ("info", "a server's tables: size, memory, counters", 5.0),
        ("checkpoint", "have a server write a checkpoint now; prints its path", 600.0),
        ("reset", "remove every row of a table (--schema: and forget its schema)", 30.0),
    ):
        sub = command(name, text)
        if name == "reset":
            sub.add_argument("table", metavar="TABLE", help="the table's name")
            sub.add_argument("--schema", action="store_true",
                             help="also forget the table's schema: the next insert fixes a new "
                                  "one (a schema the config declares stays)")
        add_channel_flags(sub)
        sub.add_argument("--timeout", type=float, default=timeout, metavar="SECONDS",
                         help=f"seconds to wait for the answer (default {timeout:g})")
        if name == "info":
            sub.add_argument("--json", action="store_true",
                             help="print every figure as JSON (exact numbers, for scripts)")
        sub.set_defaults(run=_operator(name))
    return parser


def _version() -> str:
    try:
        return metadata.version("replay-server")
    except metadata.PackageNotFoundError:
        return "unknown"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's arguments; an unknown flag is refused by its command's parser (its
    usage, not the top-level one) with the closest flag it has (``--adress``: did you mean
    ``--address``?). Exits 2 on an error, as argparse does."""
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:
        sub: argparse.ArgumentParser = args.parser
        flags = [flag for action in sub._actions for flag in action.option_strings]
        hints = []
        for word in unknown:
            close = difflib.get_close_matches(word.partition("=")[0], flags, n=1, cutoff=0.75)
            if word.startswith("-") and close:
                hints.append(f"{word!r}: did you mean {close[0]}?")
        sub.error(f"unrecognized arguments: {' '.join(unknown)}"
                  + (f" ({'; '.join(hints)})" if hints else ""))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        return int(args.run(args))
    except ConfigError as exc:  # exit 2: the server does not start; say what kind of problem
        print(f"replay-server: {_heading(exc)}: {exc}", file=sys.stderr)
        return 2


def _heading(exc: ConfigError) -> str:
    if isinstance(exc, InsufficientMemoryError):
        return "not enough memory or disk space"
    if isinstance(exc, RestoreError):
        return "cannot restore the checkpoints"
    return "configuration error"


if __name__ == "__main__":
    sys.exit(main())
