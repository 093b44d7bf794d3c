"""The ``replay-server`` command.

    replay-server serve [--config FILE] [--address HOST:PORT] [--port-file PATH]
                        [--start-empty-if-unrestorable]
    replay-server health --address HOST:PORT
    replay-server info   --address HOST:PORT
    replay-server checkpoint --address HOST:PORT

``serve`` with no config listens on 127.0.0.1:50051 with the default tables
(one per sampler kind) and says so. ``health`` exits 0 when the server is
SERVING, 1 otherwise. ``info`` prints every table's size and counters.
``checkpoint`` has the server write a checkpoint and prints its path.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from replay_proto.call_metadata import request_bytes_metadata
from replay_proto.v1 import replay_pb2 as pb
from replay_proto.v1 import replay_pb2_grpc
from replay_server.app import logs
from replay_server.app.config_file import load_settings
from replay_server.errors import ConfigError
from replay_server.service.loop import run
from replay_server.service.server import ReplayServer
from replay_server.service.settings import ServerSettings

log = logging.getLogger("replay_server")


def _serve(args: argparse.Namespace) -> int:
    logs.configure()
    settings = load_settings(args.config) if args.config else ServerSettings()
    if args.address:
        settings = dataclasses.replace(settings, address=args.address)
    if args.start_empty_if_unrestorable:
        settings = dataclasses.replace(settings, start_empty_if_unrestorable=True)
    logs.configure(settings.log_format)
    if not args.config:
        log.info("no config given: serving the default tables (one per sampler kind)")
    for table in settings.tables:
        extra = f", slice_len={table.slice_len}" if table.slice_len else ""
        log.info("table %r: sampler=%s capacity=%d%s", table.name, table.sampler.value,
                 table.capacity, extra)
    server = ReplayServer(settings)
    run(server.serve(port_file=Path(args.port_file) if args.port_file else None,
                     grace=args.grace))
    return server.exit_code


def _metadata(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    token = os.environ.get(args.token_env) if args.token_env else None
    # Info and Checkpoint requests are empty: say so, so the server reserves nothing to read them.
    return ((("authorization", f"Bearer {token}"),) if token else ()) + request_bytes_metadata(0)


def _health(args: argparse.Namespace) -> int:
    with grpc.insecure_channel(args.address) as channel:
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
    with grpc.insecure_channel(args.address) as channel:
        stub = replay_pb2_grpc.ReplayServiceStub(channel)
        try:
            response = stub.Info(pb.InfoRequest(), timeout=args.timeout, metadata=_metadata(args))
        except grpc.RpcError as exc:
            print(f"{args.address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print(format_info(response))
    return 0


def _checkpoint(args: argparse.Namespace) -> int:
    with grpc.insecure_channel(args.address) as channel:
        stub = replay_pb2_grpc.ReplayServiceStub(channel)
        try:
            response = stub.Checkpoint(pb.CheckpointRequest(), timeout=args.timeout,
                                       metadata=_metadata(args))
        except grpc.RpcError as exc:
            print(f"{args.address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print(response.path)
    print(f"{response.bytes / 1e6:.1f} MB in {response.seconds:.2f} s; rows: "
          + ", ".join(f"{name} {rows:,}" for name, rows in sorted(response.table_rows.items())),
          file=sys.stderr)
    return 0


def format_info(response: pb.InfoResponse) -> str:
    """A readable table of every table's figures."""
    header = ("table", "sampler", "size", "capacity", "fill", "inserted", "sampled",
              "prio updates", "stale", "pinned")
    rows = [header]
    for t in response.tables:
        c = t.counters
        rows.append((t.name, t.sampler + (f"[{t.slice_len}]" if t.slice_len else ""),
                     f"{t.size:,}", f"{t.capacity:,}", f"{100 * t.size / t.capacity:.1f}%",
                     f"{c.inserted:,}", f"{c.sampled:,}", f"{c.priority_updates:,}",
                     f"{c.stale_priority_updates:,}", "yes" if t.pinned else "no"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for t in response.tables:
        if t.schema:
            columns = ", ".join(f"{k}: {v}" for k, v in t.schema.items())
            lines.append(f"{t.name} columns: {columns}")
        if t.rate_limiter.enabled or t.max_times_sampled:
            lines.append(f"{t.name} flow control: {format_flow_control(t)}")
    if response.HasField("last_checkpoint"):
        last = response.last_checkpoint
        lines.append(f"last checkpoint: {last.path} ({last.created}, {last.bytes / 1e6:.1f} MB)")
    if response.HasField("limits"):
        lines.append(f"shard {response.shard}, id incarnation {response.incarnation}; "
                     f"{format_limits(response.limits)}")
    return "\n".join(lines)


def format_limits(limits: pb.ServerLimits) -> str:
    """One line: the server's limits and what is in use."""
    mib = 1 << 20
    return (f"calls hold {limits.memory_in_use_bytes / mib:.1f} of "
            f"{limits.memory_budget_bytes / mib:.0f} MiB (peak {limits.memory_peak_bytes / mib:.1f}); "
            f"{limits.calls_in_flight} of {limits.max_concurrent_calls} calls; "
            f"{limits.max_connections} connections, idle {limits.idle_timeout_s:g} s; "
            f"batches up to {limits.max_batch_bytes / mib:.0f} MiB; rings "
            f"{limits.shared_memory_in_use_bytes / mib:.1f} of "
            f"{limits.shared_memory_bytes / mib:.0f} MiB; tables "
            f"{limits.table_memory_committed_bytes / mib:.0f} of "
            f"{limits.table_memory_bytes / mib:.0f} MiB; {limits.refused_calls} calls refused")


def format_flow_control(table: pb.TableInfo) -> str:
    """One line: the table's rate limiter settings and state, and max_times_sampled."""
    r = table.rate_limiter
    parts = []
    if r.enabled:
        ratio = (f"samples_per_insert={r.samples_per_insert:g} error_buffer={r.error_buffer:g}"
                 if r.samples_per_insert else "no ratio limit")
        parts.append(
            f"min_size_to_sample={r.min_size_to_sample:,} {ratio}; inserts={r.inserts:,} "
            f"samples={r.samples:,} deletes={r.deletes:,}; "
            f"inserts {'pass' if r.can_insert else 'wait'}, "
            f"samples {'pass' if r.can_sample else 'wait'}; "
            f"waiting now: {r.blocked_inserts} inserts, {r.blocked_samples} samples"
        )
    if table.max_times_sampled:
        parts.append(f"max_times_sampled={table.max_times_sampled} "
                     f"(retired so far: {table.counters.retired:,})")
    return "; ".join(parts)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="replay-server", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run a server")
    serve.add_argument("--config", help="TOML config file (default: built-in tables)")
    serve.add_argument("--address", help="override server.address (host:port; port 0 = any)")
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
        sub.add_argument("--address", required=True, help="server host:port")
        sub.add_argument("--timeout", type=float, default=timeout,
                         help=f"seconds (default {timeout:g})")
        sub.add_argument("--token-env", default="REPLAY_TOKEN",
                         help="environment variable holding the auth token, if any")
        sub.set_defaults(run=fn)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except ConfigError as exc:
        logging.basicConfig()
        print(f"replay-server: configuration error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
