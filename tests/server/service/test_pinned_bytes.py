"""``info`` reports each table's page-locked (pinned) bytes, engine to client.

A table's storage is pinned only on a CUDA host (``pin_memory``); here the
memory columns of one table say they are pinned (the stand-in for that host:
``tests/gpu/test_device_stream.py`` checks the real thing), and the figure
must reach a client over gRPC, the other table's staying 0.
"""

from __future__ import annotations

import torch

from replay_client import ReplayClient
from replay_server.app.config_file import settings_from_dict
from replay_server.app.embedded import EmbeddedServer


def test_info_reports_the_pinned_bytes_of_each_table() -> None:
    settings = settings_from_dict({"server": {"address": "127.0.0.1:0"}, "tables": [
        {"name": "pinned", "capacity": 100}, {"name": "plain", "capacity": 100}]})
    with EmbeddedServer(settings) as server, ReplayClient(server.address) as client:
        for name in ("pinned", "plain"):
            client.insert(name, {"obs": torch.zeros(10, 84, 84, dtype=torch.uint8),
                                 "reward": torch.zeros(10)})
        storage = server.tables["pinned"]._parts.storage
        for column in storage.columns.values():
            column._pinned = True  # as memory columns allocated page-locked on a CUDA host
        info = client.info()
        assert info["pinned"].pinned and info["pinned"].pinned_bytes == \
            info["pinned"].storage_bytes == storage.nbytes > 100 * 84 * 84
        assert not info["plain"].pinned and info["plain"].pinned_bytes == 0
