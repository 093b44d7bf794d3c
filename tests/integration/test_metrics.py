"""Prometheus metrics of a real server, scraped over HTTP while a real load runs.

Every counter must move by exactly what the load did (rows, calls, status
codes, bytes), the gauges must follow what is open or waiting now, and a
bad ``metrics_address`` must stop the server at start with a clear message.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from replay_client import ReplayClient, errors
from tests.conftest import ServerProcess, start_server, wait_for
from tests.wire import encode_insert

SERVICE = "replay.v1.ReplayService"
CONFIG = """
[server]
metrics_address = "127.0.0.1:0"
checkpoint_dir = "{checkpoints}"
checkpoint_interval_s = 0

[[tables]]
name = "replay"
capacity = 50
sampler = "prioritized"

[[tables]]
name = "limited"
capacity = 100
min_size_to_sample = 5
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("metrics")
    proc = start_server(tmp, CONFIG.format(checkpoints=tmp / "checkpoints"))
    yield proc
    proc.stop()


def metrics_url(proc: ServerProcess) -> str:
    port = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", proc.log())
    assert port, proc.log()
    return f"http://127.0.0.1:{port.group(1)}/metrics"


def scrape(proc: ServerProcess) -> dict[tuple[str, frozenset], float]:
    """Every sample of one scrape: ``(name, labels) -> value``."""
    with urllib.request.urlopen(metrics_url(proc), timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(metrics: dict, name: str, **labels: str) -> float:
    return metrics.get((name, frozenset(labels.items())), 0.0)


def rpc(method: str, code: str | None = None, service: str = SERVICE, kind: str = "unary") -> dict:
    labels = {"grpc_service": service, "grpc_method": method, "grpc_type": kind}
    return labels if code is None else {**labels, "grpc_code": code}


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


ROUNDS = 30
ROWS = 4
BATCH = 8


def test_counters_move_by_exactly_the_load_scraped_while_it_runs(server) -> None:
    client = ReplayClient(server.address, timeout=30)
    rows = {"obs": torch.randn(ROWS, 3)}
    before = scrape(server)
    applied = stale = 0
    first_ids = None
    done = threading.Event()
    failures: list[BaseException] = []

    def load() -> None:
        nonlocal applied, stale, first_ids
        try:
            for _ in range(ROUNDS):
                ids = client.insert("replay", rows)
                first_ids = ids if first_ids is None else first_ids
                batch = client.sample("replay", BATCH)
                applied += client.update_priorities("replay", batch.ids, torch.ones(BATCH))
                # the first insert's rows are overwritten after 50 rows: later updates are stale
                got = client.update_priorities("replay", first_ids, torch.ones(ROWS))
                applied, stale = applied + got, stale + ROWS - got
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)
        finally:
            done.set()

    worker = threading.Thread(target=load)
    worker.start()
    scrapes_during_load = 0
    last_inserted = value(before, "replay_table_inserted_rows_total", table="replay")
    while not done.is_set():
        during = scrape(server)
        inserted = value(during, "replay_table_inserted_rows_total", table="replay")
        assert inserted >= last_inserted  # a counter never goes back
        last_inserted = inserted
        scrapes_during_load += 1
    worker.join()
    assert not failures, failures
    assert scrapes_during_load >= 1
    after = scrape(server)

    table = {"table": "replay"}
    assert delta(before, after, "replay_table_inserted_rows_total", **table) == ROUNDS * ROWS
    assert delta(before, after, "replay_table_evicted_rows_total", **table) == ROUNDS * ROWS - 50
    assert value(after, "replay_table_size_rows", **table) == 50
    assert value(after, "replay_table_capacity_rows", **table) == 50
    assert value(after, "replay_table_storage_bytes", **table) == 50 * 3 * 4
    assert delta(before, after, "replay_table_sampled_total", **table) == ROUNDS * BATCH
    assert delta(before, after, "replay_table_sample_calls_total", **table) == ROUNDS
    assert delta(before, after, "replay_table_priority_updates_total", **table) == applied
    assert delta(before, after, "replay_table_stale_priority_updates_total", **table) == stale
    assert stale > 0 and applied > 0

    for method, calls in (("Insert", ROUNDS), ("Sample", ROUNDS)):
        assert delta(before, after, "grpc_server_started_total", **rpc(method)) == calls
        assert delta(before, after, "grpc_server_handled_total", **rpc(method, "OK")) == calls
        assert delta(before, after, "grpc_server_handling_seconds_count",
                     **rpc(method, "OK")) == calls
        assert delta(before, after, "grpc_server_msg_received_total", **rpc(method)) == calls
        assert delta(before, after, "grpc_server_msg_sent_total", **rpc(method)) == calls
    # Small inserts and (on the server's host) samples travel on the client's CallStream
    # calls (still open): one message in and one answer out per request, and each is
    # counted as the unary call it stands for too. The first sample also asks for its
    # region (three more messages each way: the size it needs, the region's offer, the
    # client's answer); the update stream asks once for its local channel (one each way),
    # and the waiting updates then go over that Unix socket, counted as UpdatePriorities
    # only.
    streams = rpc("CallStream", kind="bidi_stream")
    assert delta(before, after, "grpc_server_started_total", **streams) == 3
    assert delta(before, after, "grpc_server_msg_received_total", **streams) == 2 * ROUNDS + 4
    assert delta(before, after, "grpc_server_msg_sent_total", **streams) == 2 * ROUNDS + 4
    updates = rpc("UpdatePriorities")
    assert delta(before, after, "grpc_server_started_total", **updates) == 2 * ROUNDS
    assert delta(before, after, "grpc_server_handled_total", **rpc("UpdatePriorities", "OK")
                 ) == 2 * ROUNDS
    insert_bytes = len(encode_insert("replay", rows))
    assert delta(before, after, "replay_rpc_received_bytes_total", grpc_service=SERVICE,
                 grpc_method="Insert") == ROUNDS * insert_bytes
    assert delta(before, after, "replay_rpc_sent_bytes_total", grpc_service=SERVICE,
                 grpc_method="Sample") > ROUNDS * BATCH * 3 * 4  # the rows, plus ids and weights


def test_failed_calls_are_counted_by_their_status_code(server) -> None:
    client = ReplayClient(server.address, timeout=30)
    client.insert("replay", {"obs": torch.zeros(1, 3)})
    before = scrape(server)
    for _ in range(3):
        with pytest.raises(errors.UnknownTableError):
            client.sample("no_such_table", 1)
    for _ in range(2):
        with pytest.raises(errors.SchemaMismatchError):
            client.insert("replay", {"obs": torch.zeros(1, 4)})
    # A refused call's status reaches the client as the server ends it, and is counted
    # just after: wait for the count, then check nothing else moved.
    expected = {("Sample", "NOT_FOUND"): 3, ("Insert", "INVALID_ARGUMENT"): 2}

    def counted() -> bool:
        after = scrape(server)
        return all(delta(before, after, "grpc_server_handled_total", **rpc(method, code)) == n
                   for (method, code), n in expected.items())

    assert wait_for(counted, timeout=10), scrape(server)
    after = scrape(server)
    assert delta(before, after, "grpc_server_handled_total", **rpc("Insert", "OK")) == 0
    assert delta(before, after, "grpc_server_handling_seconds_count",
                 **rpc("Sample", "NOT_FOUND")) == 3


def test_rate_limiter_waits_are_counted_and_shown_while_they_last(server) -> None:
    client = ReplayClient(server.address, timeout=1.5)
    before = scrape(server)
    waiting = {"table": "limited", "operation": "sample"}
    outcome: list[BaseException] = []

    def blocked_sample() -> None:
        try:
            client.sample("limited", 1)  # the table is empty: held back until the deadline
        except errors.ReplayError as exc:
            outcome.append(exc)

    sampler = threading.Thread(target=blocked_sample)
    sampler.start()
    assert wait_for(lambda: value(scrape(server), "replay_rate_limiter_waiting_calls",
                                  **waiting) == 1, timeout=10)
    sampler.join()
    assert len(outcome) == 1 and isinstance(outcome[0], errors.DeadlineExceededError)
    assert wait_for(lambda: delta(before, scrape(server), "grpc_server_handled_total",
                                  **rpc("Sample", "DEADLINE_EXCEEDED")) == 1, timeout=10)
    after = scrape(server)
    assert value(after, "replay_rate_limiter_waiting_calls", **waiting) == 0
    assert delta(before, after, "replay_rate_limiter_blocked_calls_total", **waiting) == 1
    # the server holds the call until shortly before its 1.5 s deadline (docs: waiting.py)
    assert delta(before, after, "replay_rate_limiter_blocked_seconds_total", **waiting) >= 1.0


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shared_memory", "grpc"])
def test_open_streams_are_shown_by_transport_until_closed(server, shared_memory) -> None:
    client = ReplayClient(server.address, timeout=30)
    client.insert("replay", {"obs": torch.zeros(8, 3)})
    transport = "shared_memory" if shared_memory else "grpc"
    stream_rpc = {"grpc_service": SERVICE, "grpc_method": "SampleStream"}
    stream = client.stream("replay", 4, prefetch=2, shared_memory=shared_memory)
    next(stream)  # one batch taken: the stream is open, its transport settled
    assert stream.transport == transport
    assert wait_for(lambda: value(scrape(server), "replay_sample_streams_open",
                                  transport=transport) == 1, timeout=10)
    assert value(scrape(server), "replay_rpc_open_streams", **stream_rpc) == 1
    def ended(metrics: dict) -> float:  # the learner's close: a half-close (OK) or a cancel
        return sum(value(metrics, "grpc_server_handled_total",
                         **rpc("SampleStream", kind="bidi_stream", code=code))
                   for code in ("OK", "CANCELLED"))

    before = ended(scrape(server))
    stream.close()

    def closed() -> bool:
        after = scrape(server)
        return (value(after, "replay_sample_streams_open", transport=transport) == 0
                and value(after, "replay_rpc_open_streams", **stream_rpc) == 0
                and ended(after) == before + 1)

    assert wait_for(closed, timeout=10), scrape(server)


def test_checkpoint_figures_process_memory_and_health_checks(server) -> None:
    before = scrape(server)
    path = ReplayClient(server.address, timeout=60).checkpoint()
    from replay_server.app.cli import main

    assert main(["health", "--address", server.address]) == 0
    after = scrape(server)
    assert delta(before, after, "replay_checkpoints_total", outcome="written") == 1
    assert value(after, "replay_checkpoints_total", outcome="failed") == 0
    size = value(after, "replay_checkpoint_last_size_bytes")
    assert size > 0 and path
    assert value(after, "replay_checkpoint_last_duration_seconds") > 0
    assert abs(value(after, "replay_checkpoint_last_timestamp_seconds") - time.time()) < 600
    assert 0 <= value(after, "replay_checkpoint_age_seconds") < 600
    assert value(after, "process_resident_memory_bytes") > 10 * 2**20
    assert delta(before, after, "grpc_server_handled_total",
                 **rpc("Check", "OK", service="grpc.health.v1.Health")) == 1
    from importlib import metadata

    assert value(after, "replay_server_info", version=metadata.version("replay-server")) == 1


# ------------------------------------------------------------------ bad addresses


def _serve(tmp_path, server_lines: str) -> subprocess.CompletedProcess:
    config = tmp_path / "metrics.toml"
    config.write_text(f'[server]\naddress = "127.0.0.1:0"\n{server_lines}\n'
                      '[[tables]]\nname = "t"\ncapacity = 10\n')
    return subprocess.run([sys.executable, "-m", "replay_server.app.cli", "serve", "--config",
                           str(config)], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("address", ["127.0.0.1", "127.0.0.1:99999", ":9100", 9100])
def test_a_malformed_metrics_address_is_refused_naming_it(address) -> None:
    from replay_server.app.config_file import settings_from_dict
    from replay_server.errors import ConfigError

    with pytest.raises(ConfigError) as error:
        settings_from_dict({"server": {"metrics_address": address}})
    assert f"server.metrics_address must be 'host:port', got {address!r}" in str(error.value)


def test_a_metrics_address_in_use_stops_the_server_naming_it(tmp_path) -> None:
    """Through ``replay-server serve``: exit status 2 and the reason, nothing left running."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _serve(tmp_path, f'metrics_address = "127.0.0.1:{port}"')
    assert result.returncode == 2, result.stderr
    assert f"server.metrics_address '127.0.0.1:{port}': cannot listen there" in result.stderr
    assert "in use" in result.stderr
