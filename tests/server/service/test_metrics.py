"""replay_server.service.metrics: a scrape reads the engine without waiting on it."""

from __future__ import annotations

import threading

import torch
from prometheus_client import generate_latest

from replay_server.engine.config import TableConfig
from replay_server.engine.table_set import TableSet
from replay_server.service.metrics import MetricsSource, ServerMetrics
from replay_server.service.waiting import BlockedCalls


def _metrics(tables: TableSet) -> ServerMetrics:
    blocked = BlockedCalls(lambda table, operation, count: True)
    return ServerMetrics("127.0.0.1:0", MetricsSource(
        tables=lambda: tables, blocked=blocked.totals, streams=dict, checkpointer=None,
        version="test"))


def test_a_scrape_completes_while_a_table_is_locked() -> None:
    tables = TableSet([TableConfig(name="busy", capacity=10)])
    table = tables["busy"]
    table.insert({"obs": torch.zeros(3, 2)})
    metrics = _metrics(tables)
    scraped = threading.Event()
    text: list[bytes] = []

    def scrape() -> None:
        text.append(generate_latest(metrics.registry))
        scraped.set()

    with table._lock:  # a long sample or snapshot holds the lock: the scrape must not wait
        worker = threading.Thread(target=scrape, daemon=True)
        worker.start()
        assert scraped.wait(timeout=20), "the scrape waited on the table's lock"
    assert b'replay_table_size_rows{table="busy"} 3.0' in text[0]
    assert b'replay_table_inserted_rows_total{table="busy"} 3.0' in text[0]


def test_figures_match_the_locked_info() -> None:
    tables = TableSet([TableConfig(name="t", capacity=4, sampler="prioritized")])
    table = tables["t"]
    ids = torch.cat([table.insert({"obs": torch.zeros(3, 2)}) for _ in range(2)])
    table.sample(3)
    table.update_priorities(ids, torch.ones(6))  # two of the six were overwritten
    figures, info = table.figures(), table.info()
    assert (figures.size, figures.capacity, figures.storage_bytes) == (
        info.size, info.capacity, info.storage_bytes)
    assert figures.counters == info.counters
    assert (figures.counters.priority_updates, figures.counters.stale_priority_updates) == (4, 2)


def test_the_endpoint_serves_the_registry_and_stops(tmp_path) -> None:
    import urllib.request

    metrics = _metrics(TableSet([TableConfig(name="t", capacity=4)]))
    port = metrics.start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            body = response.read()
        assert b'replay_table_capacity_rows{table="t"} 4.0' in body
        assert b"process_resident_memory_bytes" in body
    finally:
        metrics.stop()
    import socket

    import pytest

    with pytest.raises(ConnectionRefusedError):  # nothing listens there any more
        socket.create_connection(("127.0.0.1", port), timeout=10).close()


def test_queue_tables_report_their_depth_and_deletes() -> None:
    tables = TableSet([TableConfig(name="q", capacity=10, sampler="fifo"),
                       TableConfig(name="plain", capacity=10)])
    ids = tables["q"].insert({"obs": torch.zeros(5, 2)})
    tables["q"].sample(2)
    tables["q"].delete(ids[3:4])
    tables["plain"].insert({"obs": torch.zeros(5, 2)})
    text = generate_latest(_metrics(tables).registry)
    assert b'replay_queue_depth_rows{table="q"} 2.0' in text
    assert b'replay_table_deleted_rows_total{table="q"} 1.0' in text
    assert b'replay_queue_depth_rows{table="plain"}' not in text  # only queue tables have one
