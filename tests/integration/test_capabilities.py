"""``info()`` reports what each table does (``TableCapabilities``), through a real server.

Clients decide on these fields (is a table prioritized, sliced, a queue, can a
sharded client merge its samples?), never on the sampler's name; the values
here are the contract each sampler and reader declares.
"""

from __future__ import annotations

import pytest

from replay_client import ReplayClient, TableCapabilities
from tests.conftest import module_server

CONFIG = """
[[tables]]
name = "uniform"
capacity = 100
sampler = "uniform"
max_times_sampled = 2

[[tables]]
name = "prioritized"
capacity = 100
sampler = "prioritized"
n_step = 3

[[tables]]
name = "slice"
capacity = 100
sampler = "slice"
slice_len = 4

[[tables]]
name = "prioritized_slice"
capacity = 100
sampler = "prioritized_slice"
slice_len = 4

[[tables]]
name = "fifo"
capacity = 100
sampler = "fifo"

[[tables]]
name = "frames"
capacity = 100
sampler = "uniform"
frame_stack_key = "obs"
"""

server = module_server(CONFIG)

EXPECTED = {
    "uniform": TableCapabilities(retires=True),
    "prioritized": TableCapabilities(priorities=True, n_step=3),
    "slice": TableCapabilities(slices=True, episodes=True),
    "prioritized_slice": TableCapabilities(priorities=True, slices=True, episodes=True),
    "fifo": TableCapabilities(consumes=True, ordered=True, mergeable=False),
    "frames": TableCapabilities(frame_stack_key="obs"),
}


@pytest.mark.parametrize("table", sorted(EXPECTED))
def test_info_reports_each_tables_capabilities(server, table: str) -> None:
    with ReplayClient(server.address) as client:
        assert client.info()[table].capabilities == EXPECTED[table]
