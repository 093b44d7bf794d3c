"""One server for the RemoteReplayBuffer tests; each test gets tables no other test used."""

from __future__ import annotations

import itertools

import pytest

from replay_client import ReplayClient
from tests.conftest import start_server

KINDS = {
    "rows": 'sampler = "uniform"',
    "per": 'sampler = "prioritized"\nalpha = 0.6\nbeta = 0.4',
    "seq": 'sampler = "slice"\nslice_len = 4\ndone_key = "next.done"',
    "pseq": 'sampler = "prioritized_slice"\nslice_len = 4\ndone_key = "next.done"',
    "short": 'sampler = "slice"\nslice_len = 4\ndone_key = "next.done"\nstrict_length = false',
    "pshort": 'sampler = "prioritized_slice"\nslice_len = 4\ndone_key = "next.done"\n'
              'strict_length = false\nalpha = 1.0',
    "span": 'sampler = "prioritized_slice"\nslice_len = 4\ndone_key = "next.done"\n'
            'span_right = 2',
    "spans": 'sampler = "slice"\nslice_len = 4\ndone_key = "next.done"\n'
             'span_left = 2\nspan_right = 2',
}
TABLES_PER_KIND = 32
CAPACITY = {"rows": 10, "per": 100, "seq": 1000, "pseq": 1000, "short": 1000, "pshort": 1000,
            "span": 1000, "spans": 1000}


@pytest.fixture(scope="package")
def buffer_server(tmp_path_factory):
    config = "".join(
        f'[[tables]]\nname = "{kind}{i}"\ncapacity = {CAPACITY[kind]}\nseed = {i}\n{settings}\n\n'
        for kind, settings in KINDS.items() for i in range(TABLES_PER_KIND))
    proc = start_server(tmp_path_factory.mktemp("buffers"), config)
    yield proc
    proc.stop()


_used = {kind: itertools.count() for kind in KINDS}


@pytest.fixture
def fresh(buffer_server):
    """``fresh(kind)``: the name of a table of ``kind`` (rows: uniform, capacity 10; per:
    prioritized, capacity 100; seq / pseq: slices of 4, capacity 1000; short / pshort: slices
    of 4 with strict_length = false, span: prioritized slices of 4 with span_right = 2, spans:
    slices of 4 with span_left = span_right = 2,
    capacity 1000) no test used before."""
    def make(kind: str) -> str:
        n = next(_used[kind])
        assert n < TABLES_PER_KIND, f"add tables of kind {kind!r} to the test server"
        return f"{kind}{n}"

    return make


@pytest.fixture
def client(buffer_server) -> ReplayClient:
    return ReplayClient(buffer_server.address, timeout=10)
