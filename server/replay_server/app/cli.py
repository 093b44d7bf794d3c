"""The ``replay-server`` command.

    replay-server serve [--config FILE] [--address HOST:PORT] [--checkpoint-dir DIR]
                        [--port-file PATH] [--start-empty-if-unrestorable]
    replay-server health     [--address HOST:PORT] [TLS flags]
    replay-server info       [--address HOST:PORT] [--json] [TLS flags]
    replay-server checkpoint [--address HOST:PORT] [TLS flags]
    replay-server --version

``serve`` with no config listens on 127.0.0.1:50051 with the default tables
(one per sampler kind) and says so; without a checkpoint directory it warns
that rows are lost at stop. The operator's commands talk to 127.0.0.1:50051
unless ``--address`` says otherwise (TLS and token flags:
:mod:`replay_server.app.channel`). ``health`` exits 0 when the server is
SERVING, 1 otherwise. ``info`` prints every table's size, memory and
counters (``--json``: every figure, exact). ``checkpoint`` has the server
write a checkpoint and prints its path. Exit status 2: a configuration or
usage error.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from replay_proto.v1 import replay_pb2 as pb
from replay_proto.v1 import replay_pb2_grpc
from replay_server.app import logs
from replay_server.app.channel import add_channel_flags, call_metadata, open_channel
from replay_server.app.config_file import load_settings
from replay_server.app.heap import keep_request_buffers
from replay_server.app.info_table import format_info, info_json
from replay_server.errors import ConfigError, InsufficientMemoryError, RestoreError
from replay_server.service.loop import run
from replay_server.service.server import ReplayServer, server_version
from replay_server.service.settings import ServerSettings

log = logging.getLogger("replay_server")


def _serve(args: argparse.Namespace) -> int:
    logs.configure()
    settings = load_settings(args.config) if args.config else ServerSettings()
    if args.address:
        settings = dataclasses.replace(settings, address=args.address)
    if args.start_empty_if_unrestorable:
        settings = dataclasses.replace(settings, start_empty_if_unrestorable=True)
    if args.checkpoint_dir:
        settings = dataclasses.replace(settings, checkpoint_dir=args.checkpoint_dir)
    logs.configure(settings.log_format)
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


def _health(args: argparse.Namespace) -> int:
    with open_channel(args) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=args.timeout)
        except grpc.RpcError as exc:
            print(f"{args.address}: {exc.code().name}: {exc.details()}")
            return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status.status)
    print(f"{args.address}: {name}")
    return 0 if status.status == health_pb2.HealthCheckResponse.SERVING else 1


def _info(args: argparse.Namespace) -> int:
    metadata = call_metadata(args)
    with open_channel(args) as channel:
        stub = replay_pb2_grpc.ReplayServiceStub(channel)
        try:
            response = stub.Info(pb.InfoRequest(), timeout=args.timeout, metadata=metadata)
        except grpc.RpcError as exc:
            print(f"{args.address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print(info_json(response) if args.json else format_info(response))
    return 0


def _checkpoint(args: argparse.Namespace) -> int:
    metadata = call_metadata(args)
    with open_channel(args) as channel:
        stub = replay_pb2_grpc.ReplayServiceStub(channel)
        try:
            response = stub.Checkpoint(pb.CheckpointRequest(), timeout=args.timeout,
                                       metadata=metadata)
        except grpc.RpcError as exc:
            print(f"{args.address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print(response.path)
    print(f"{response.bytes / 1e6:.1f} MB in {response.seconds:.2f} s; rows: "
          + ", ".join(f"{name} {rows:,}" for name, rows in sorted(response.table_rows.items())),
          file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="replay-server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version",
                        version=f"replay-server {server_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run a server")
    serve.add_argument("--config", help="TOML config file (default: built-in tables)")
    serve.add_argument("--address", help="override server.address (host:port; port 0 = any)")
    serve.add_argument("--checkpoint-dir", metavar="DIR",
                       help="override server.checkpoint_dir (restored at start, written at stop)")
    serve.add_argument("--port-file", help="write the bound port to this file once listening")
    serve.add_argument("--grace", type=float, default=10.0,
                       help="seconds in-flight calls get to finish at shutdown (default 10)")
    serve.add_argument("--start-empty-if-unrestorable", action="store_true",
                       help="start with empty tables when checkpoints exist but none can be "
                            "restored (default: refuse to start); the checkpoints are kept")
    serve.set_defaults(run=_serve)
    for name, fn, text, timeout in (
        ("health", _health, "check a server's health", 5.0),
        ("info", _info, "print a server's tables", 5.0),
        ("checkpoint", _checkpoint, "have a server write a checkpoint; prints its path", 600.0),
    ):
        sub = commands.add_parser(name, help=text)
        add_channel_flags(sub)
        sub.add_argument("--timeout", type=float, default=timeout,
                         help=f"seconds (default {timeout:g})")
        if name == "info":
            sub.add_argument("--json", action="store_true",
                             help="print every figure as JSON (exact numbers, for scripts)")
        sub.set_defaults(run=fn)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except ConfigError as exc:  # exit 2: the server does not start; say what kind of problem
        logging.basicConfig()
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
