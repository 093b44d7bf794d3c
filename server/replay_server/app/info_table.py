"""What ``replay-server info`` prints: a readable table in human units, or JSON.

The table rounds for people (``1.2M`` rows, ``26.4 MiB``); the JSON
(``--json``) keeps every figure exact, with the field names of
``InfoResponse`` in ``replay.proto`` and integers as numbers, for scripts.
"""

from __future__ import annotations

import json
from typing import Any

from google.protobuf.message import Message

from replay_proto.v1 import replay_pb2 as pb


def format_info(response: pb.InfoResponse) -> str:
    """A readable table of every table's figures, the server's memory and checkpoints."""
    header = ("table", "sampler", "size", "capacity", "fill", "memory", "inserted", "sampled",
              "prio updates", "stale", "pinned")
    rows = [header]
    for t in response.tables:
        c = t.counters
        fill = f"{100 * t.size / t.capacity:.1f}%" if t.capacity else "-"
        rows.append((t.name, t.sampler + (f"[{t.slice_len}]" if t.slice_len else ""),
                     count(t.size), count(t.capacity), fill, nbytes(t.storage_bytes),
                     count(c.inserted), count(c.sampled), count(c.priority_updates),
                     count(c.stale_priority_updates), "yes" if t.pinned else "no"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if response.HasField("server"):
        lines.insert(0, format_server(response.server, response.tables))
    for t in response.tables:
        if t.schema:
            columns = ", ".join(f"{k}: {v}" for k, v in t.schema.items())
            lines.append(f"{t.name} columns: {columns}")
        if t.rate_limiter.enabled or t.max_times_sampled:
            lines.append(f"{t.name} flow control: {format_flow_control(t)}")
    if response.server.restored_checkpoint:
        lines.append(f"restored at start from: {response.server.restored_checkpoint}")
    if response.HasField("last_checkpoint"):
        last = response.last_checkpoint
        lines.append(f"last checkpoint: {last.path} ({last.created}, {nbytes(last.bytes)})")
    if response.HasField("limits"):
        lines.append(f"shard {response.shard}, id incarnation {response.incarnation}; "
                     f"{format_limits(response.limits)}")
    return "\n".join(lines)


def format_limits(limits: pb.ServerLimits) -> str:
    """One line: the server's limits and what is in use."""
    return (f"calls hold {nbytes(limits.memory_in_use_bytes)} of "
            f"{nbytes(limits.memory_budget_bytes)} (peak {nbytes(limits.memory_peak_bytes)}); "
            f"{limits.calls_in_flight} of {limits.max_concurrent_calls} calls, "
            f"{limits.calls_waiting} of {limits.max_waiting_calls} waiting ({limits.streams_open} "
            f"of {limits.max_streams} streams; {limits.max_host_share:g} of each per address; "
            f"all calls may hold "
            f"{nbytes(limits.transport_bound_bytes)} at most); "
            f"{limits.connections_open} of {limits.max_connections} connections, idle "
            f"{limits.idle_timeout_s:g} s ({limits.connections_closed} closed without a call), "
            f"pinged every {limits.keepalive_s:g} s (closed {limits.keepalive_timeout_s:g} s "
            f"after an unanswered ping); "
            f"batches up to {nbytes(limits.max_batch_bytes)}; rings "
            f"{nbytes(limits.shared_memory_in_use_bytes)} of {nbytes(limits.shared_memory_bytes)}; "
            f"tables {nbytes(limits.table_memory_committed_bytes)} of "
            f"{nbytes(limits.table_memory_bytes)}; {limits.refused_calls} calls refused "
            f"({limits.refused_calls_host_share} for their address's share)")


def format_server(server: pb.ServerInfo, tables: Any) -> str:
    """One line: version, uptime, memory, security, persistence."""
    stored = sum(t.storage_bytes for t in tables)
    security = ("mutual TLS" if server.mutual_tls else "TLS" if server.tls else "plaintext")
    security += ", token" if server.auth else ""
    persistence = (f"checkpoints in {server.checkpoint_dir}" if server.checkpoint_dir
                   else "no checkpoint_dir: rows are lost at stop")
    if server.wal and server.wal != "off":
        persistence += f", write-ahead log (wal_sync = {server.wal})"
    return (f"replay-server {server.version}, up {duration(server.uptime_seconds)}; memory "
            f"{nbytes(server.rss_bytes)} resident, tables {nbytes(stored)}; {security}; "
            f"{persistence}")


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


def info_json(response: pb.InfoResponse) -> str:
    """``response`` as JSON: proto field names, exact integers, every field present."""
    return json.dumps(plain(response), indent=2, sort_keys=False)


def plain(message: Message) -> dict[str, Any]:
    """A message as plain dicts, lists and numbers (unset sub-messages: ``None``).

    Unlike protobuf's JSON mapping, int64 stays a number, and non-finite
    doubles become the strings ``"inf"``, ``"-inf"`` and ``"nan"``.
    """
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            out[field.name] = {k: _value(value_field, v) for k, v in value.items()}
        elif field.is_repeated:
            out[field.name] = [_value(field, v) for v in value]
        elif field.message_type is not None and not message.HasField(field.name):
            out[field.name] = None
        else:
            out[field.name] = _value(field, value)
    return out


def _value(field: Any, value: Any) -> Any:  # a FieldDescriptor (python or upb)
    if field.message_type is not None:
        return plain(value)
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return str(value)
    return value


def count(n: int) -> str:
    """``n`` in three significant figures: ``950``, ``12.3k``, ``100k``, ``1.25M``, ``2.00G``."""
    if abs(n) < 1000:
        return str(n)
    for unit, scale in (("k", 1e3), ("M", 1e6), ("G", 1e9), ("T", 1e12)):
        value = n / scale
        if abs(value) < 999.5 or unit == "T":
            return f"{value:.3g}{unit}" if value < 100 else f"{value:.0f}{unit}"
    raise AssertionError("unreachable")


def nbytes(n: int) -> str:
    """Bytes in binary units: ``512 B``, ``26.4 MiB``, ``1.50 GiB``."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    raise AssertionError("unreachable")


def duration(seconds: float) -> str:
    """``42s``, ``5m 03s``, ``3h 07m``, ``2d 04h``."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600:02d}h"
