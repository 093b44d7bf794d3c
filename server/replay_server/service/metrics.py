"""Prometheus metrics of a server, served over HTTP on ``server.metrics_address``.

Three sources, one registry per server:

- :class:`~replay_server.service.rpc_metrics.RpcMetrics`, the interceptor
  that counts and times every call by method and status code;
- :class:`EngineCollector`, read at scrape time from what the engine and the
  service already count (no second bookkeeping on the hot path):

      replay_table_size_rows / _capacity_rows / _storage_bytes{table}
      replay_table_inserted_rows_total / _evicted_rows_total / _retired_rows_total /
      _returned_rows_total{table}
      replay_table_sampled_total / _sample_calls_total{table}    (a slice counts once)
      replay_table_priority_updates_total / _stale_priority_updates_total{table}
      replay_table_resets_total{table}
      replay_table_deleted_rows_total{table}, replay_queue_depth_rows{table} (fifo/lifo tables)
      replay_rate_limiter_blocked_calls_total / _blocked_seconds_total{table, operation}
      replay_rate_limiter_waiting_calls{table, operation}
      replay_sample_streams_open{transport}                     grpc | each registered sink (shared_memory)
      replay_checkpoints_total{outcome}                         written | failed
      replay_checkpoint_last_duration_seconds / _last_size_bytes
      replay_checkpoint_last_timestamp_seconds / _age_seconds
      replay_server_info{version}

- prometheus_client's process collector: ``process_resident_memory_bytes``,
  CPU seconds, open file descriptors.

A scrape never blocks the server: it runs on the HTTP server's own thread
and reads counters without taking any table's lock
(:meth:`~replay_server.engine.table.Table.figures`), so a busy table or a
slow scraper delays nobody; figures of one table may be one call apart.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from replay_server.checkpoint import Checkpointer
from replay_server.engine import Table
from replay_server.errors import ConfigError
from replay_server.service.metrics_listener import MetricsListener
from replay_server.service.rpc_metrics import RpcMetrics
from replay_server.service import sinks
from replay_server.service.waiting import BlockedTotals

log = logging.getLogger("replay_server")


@dataclass(frozen=True)
class MetricsSource:
    """What a scrape reads: callables, so tables swapped in by a restore are seen.

    Attributes:
        tables: the tables served now.
        blocked: the rate limiter's waiting calls (``BlockedCalls.totals``).
        streams: open SampleStream calls by transport (``grpc``, ``shared_memory``).
        checkpointer: the server's checkpointer (``None``: no checkpoint_dir).
        version: the server's version.
    """

    tables: Callable[[], Iterable[Table]]
    blocked: Callable[[], BlockedTotals]
    streams: Callable[[], dict[str, int]]
    checkpointer: Checkpointer | None
    version: str


class ServerMetrics:
    """A server's metrics registry and its ``/metrics`` HTTP endpoint.

    Args:
        address: ``host:port`` to serve ``/metrics`` on (port 0: any free port).
        source: what the engine collector reads at scrape time.

    Attributes:
        rpc: the interceptor to install first on the gRPC server.
        registry: every metric of this server (one registry per server, so
            several servers in one process do not mix).
    """

    def __init__(self, address: str, source: MetricsSource) -> None:
        disable_created_metrics()  # no ``*_created`` series: half the output, no use here
        self.address = address
        self.registry = CollectorRegistry()
        self.rpc = RpcMetrics()
        self.registry.register(self.rpc)
        self.registry.register(EngineCollector(source))
        ProcessCollector(registry=self.registry)
        self._http: MetricsListener | None = None
        self.port: int | None = None

    def start(self) -> int:
        """Listen for scrapes (:class:`~replay_server.service.metrics_listener.MetricsListener`:
        a few threads, a few connections, each timed out); returns the bound port.

        Raises:
            ConfigError: the address cannot be bound (in use, not a local address).
        """
        host, port = self.address.rsplit(":", 1)
        host = host.strip("[]")
        try:
            self._http = MetricsListener(host, int(port), self.registry)
        except OSError as exc:
            raise ConfigError(
                f"server.metrics_address {self.address!r}: cannot listen there "
                f"({exc.strerror or exc})") from None
        self._http.start()
        self.port = self._http.port
        log.info("metrics on http://%s:%d/metrics", host if ":" not in host else f"[{host}]",
                 self.port)
        return self.port

    def stop(self) -> None:
        """Stop answering scrapes (idempotent)."""
        http, self._http = self._http, None
        if http is not None:
            http.stop()


class EngineCollector(Collector):
    """Builds the table, rate limiter, stream and checkpoint families at each scrape."""

    def __init__(self, source: MetricsSource) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        yield from self._tables()
        yield from self._blocked()
        streams = GaugeMetricFamily("replay_sample_streams_open",
                                    "SampleStream calls open now, by transport.",
                                    labels=["transport"])
        open_streams = self._source.streams()
        for transport in ("grpc", *sinks.SINKS):
            streams.add_metric([transport], open_streams.get(transport, 0))
        yield streams
        yield from self._checkpoints()
        info = GaugeMetricFamily("replay_server_info", "The server's version (value 1).",
                                 labels=["version"])
        info.add_metric([self._source.version], 1)
        yield info

    def _tables(self) -> Iterator[Metric]:
        gauges = {
            "size": GaugeMetricFamily("replay_table_size_rows", "Rows stored now.",
                                      labels=["table"]),
            "capacity": GaugeMetricFamily("replay_table_capacity_rows", "Rows the table holds "
                                          "at most.", labels=["table"]),
            "storage_bytes": GaugeMetricFamily("replay_table_storage_bytes", "Bytes of row "
                                               "storage allocated (its capacity).",
                                               labels=["table"]),
            "queue_depth": GaugeMetricFamily("replay_queue_depth_rows", "Rows waiting to be "
                                             "taken from a queue table (fifo/lifo).",
                                             labels=["table"]),
        }
        counters = {
            "inserted": ("replay_table_inserted_rows", "Rows inserted."),
            "evicted": ("replay_table_evicted_rows", "Rows overwritten by newer ones."),
            "retired": ("replay_table_retired_rows", "Rows retired by max_times_sampled."),
            "sampled": ("replay_table_sampled", "Batch entries drawn (rows; a slice counts "
                                                "once)."),
            "sample_calls": ("replay_table_sample_calls", "Batches drawn."),
            "priority_updates": ("replay_table_priority_updates", "Priority updates applied."),
            "stale_priority_updates": ("replay_table_stale_priority_updates",
                                       "Priority updates ignored: their row was overwritten "
                                       "or reset."),
            "resets": ("replay_table_resets", "Resets of the table."),
            "deleted": ("replay_table_deleted_rows", "Rows removed by Delete."),
            "returned": ("replay_table_returned_rows", "Rows taken from a queue under a lease "
                         "that came back to it (the lease expired, or its stream ended "
                         "before the learner finished them)."),
        }
        families = {key: CounterMetricFamily(name, text, labels=["table"])
                    for key, (name, text) in counters.items()}
        for table in self._source.tables():
            figures = table.figures()
            labels = [table.name]
            gauges["size"].add_metric(labels, figures.size)
            gauges["capacity"].add_metric(labels, figures.capacity)
            gauges["storage_bytes"].add_metric(labels, figures.storage_bytes)
            if table.config.sampler.is_queue:
                gauges["queue_depth"].add_metric(labels, figures.size)
            for key, family in families.items():
                family.add_metric(labels, getattr(figures.counters, key))
        yield from gauges.values()
        yield from families.values()

    def _blocked(self) -> Iterator[Metric]:
        totals = self._source.blocked()
        labels = ["table", "operation"]
        calls = CounterMetricFamily("replay_rate_limiter_blocked_calls",
                                    "Calls a rate limiter held back (each counted once).",
                                    labels=labels)
        seconds = CounterMetricFamily("replay_rate_limiter_blocked_seconds",
                                      "Seconds calls spent held back (added as each wait ends).",
                                      labels=labels)
        waiting = GaugeMetricFamily("replay_rate_limiter_waiting_calls",
                                    "Calls held back now.", labels=labels)
        for table in self._source.tables():
            for operation in ("insert", "sample"):
                key = (table.name, operation)
                calls.add_metric(list(key), totals.calls.get(key, 0))
                seconds.add_metric(list(key), totals.seconds.get(key, 0.0))
                waiting.add_metric(list(key), totals.waiting.get(key, 0))
        yield from (calls, seconds, waiting)

    def _checkpoints(self) -> Iterator[Metric]:
        checkpointer = self._source.checkpointer
        if checkpointer is None:
            return
        outcomes = CounterMetricFamily("replay_checkpoints", "Checkpoint writes since start.",
                                       labels=["outcome"])
        outcomes.add_metric(["written"], checkpointer.written)
        outcomes.add_metric(["failed"], checkpointer.failed)
        yield outcomes
        last, finished = checkpointer.last, checkpointer.last_finished_at
        if last is None or finished is None:
            return
        yield GaugeMetricFamily("replay_checkpoint_last_duration_seconds",
                                "How long the newest checkpoint took to write.", value=last.seconds)
        yield GaugeMetricFamily("replay_checkpoint_last_size_bytes",
                                "Bytes of the newest checkpoint.", value=last.nbytes)
        yield GaugeMetricFamily("replay_checkpoint_last_timestamp_seconds",
                                "When the newest checkpoint was finished (Unix time).",
                                value=finished)
        yield GaugeMetricFamily("replay_checkpoint_age_seconds",
                                "Seconds since the newest checkpoint was finished.",
                                value=time.time() - finished)
