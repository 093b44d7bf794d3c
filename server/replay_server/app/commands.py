"""The operator's commands: ``health``, ``info``, ``checkpoint`` and ``reset`` of a running server.

Each one makes one call over a channel of :mod:`replay_server.app.channel`
and prints its answer on stdout; a failure is a
:class:`CommandError` (the command line prints it on stderr and exits 1).
They load grpc and the generated protobuf code only, never torch: a health
probe costs a fraction of a second.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from replay_proto.error_kinds import ERROR_KIND_KEY
from replay_proto.v1 import replay_pb2 as pb
from replay_proto.v1 import replay_pb2_grpc
from replay_server.app.channel import call_metadata, open_channel
from replay_server.app.info_table import format_info, info_json


class CommandError(Exception):
    """An operator's command failed: the server refused it, or could not be reached."""


def health(args: argparse.Namespace) -> int:
    """Print the server's health; 0 when SERVING, 1 otherwise (NOT_SERVING: restoring, draining)."""
    status = _call(args, lambda channel: health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=""), timeout=args.timeout))
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status.status)
    print(f"{args.address}: {name}")
    return 0 if status.status == health_pb2.HealthCheckResponse.SERVING else 1


def info(args: argparse.Namespace) -> int:
    """Print every table's figures (``--json``: exact, for scripts)."""
    metadata = call_metadata(args)
    response = _call(args, lambda channel: replay_pb2_grpc.ReplayServiceStub(channel).Info(
        pb.InfoRequest(), timeout=args.timeout, metadata=metadata))
    print(info_json(response) if args.json else format_info(response))
    return 0


def checkpoint(args: argparse.Namespace) -> int:
    """Have the server write a checkpoint; print its path (stdout, for scripts) and its size
    and rows (stderr)."""
    metadata = call_metadata(args)
    response = _call(args, lambda channel: replay_pb2_grpc.ReplayServiceStub(channel).Checkpoint(
        pb.CheckpointRequest(), timeout=args.timeout, metadata=metadata))
    print(response.path)
    print(f"{response.bytes / 1e6:.1f} MB in {response.seconds:.2f} s; rows: "
          + ", ".join(f"{name} {rows:,}" for name, rows in sorted(response.table_rows.items())),
          file=sys.stderr)
    return 0


def reset(args: argparse.Namespace) -> int:
    """Remove every row of a table (``--schema``: and forget its schema)."""
    request = pb.ResetRequest(table=args.table, schema=args.schema)
    metadata = call_metadata(args, request.ByteSize())
    _call(args, lambda channel: replay_pb2_grpc.ReplayServiceStub(channel).Reset(
        request, timeout=args.timeout, metadata=metadata))
    print(f"table {args.table!r} reset: no rows"
          + ("; its schema is fixed again by the next insert (or the config's)"
             if args.schema else "; its schema stays"))
    return 0


def _call(args: argparse.Namespace, call: Callable[[grpc.Channel], Any]) -> Any:
    """``call`` on a channel to ``args.address``; a failed call as a :class:`CommandError`."""
    with open_channel(args) as channel:
        try:
            return call(channel)
        except grpc.RpcError as exc:
            raise CommandError(_failure(args.address, exc)) from None


def _failure(address: str, exc: grpc.RpcError) -> str:
    """What an operator reads of a failed call: an unreachable server says so plainly."""
    code, details = exc.code(), exc.details() or ""
    answered = any(key == ERROR_KIND_KEY for key, _ in exc.trailing_metadata() or ())
    if code is grpc.StatusCode.UNAVAILABLE and not answered:
        return f"no replay server at {address} (is it running?): {details}"
    if code is grpc.StatusCode.DEADLINE_EXCEEDED and not answered:
        return f"{address} did not answer in time (--timeout): {details}"
    return f"{address}: {code.name}: {details}"


def print_error(message: str) -> None:
    """One error line on stderr, the same shape for every command."""
    print(f"replay-server: error: {message}", file=sys.stderr)
