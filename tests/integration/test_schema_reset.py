"""A table's schema can be started over: ``ReplayClient.reset(table, schema=True)``.

Issue 24, friction 4: after the README's examples fixed ``replay``'s schema
(``obs``, ``reward``, ...), TorchRL-named data (``observation``, ...) was
refused with no way out but deleting checkpoints. The refusal now names the
way out, and taking it lets the next insert fix a new schema, which then
survives a checkpoint and restart. Real server, real client, real files.
"""

from __future__ import annotations

import pytest
import torch

from replay_client import ReplayClient, errors
from tests.conftest import start_server

CONFIG = """
[server]
checkpoint_dir = "{checkpoints}"
checkpoint_interval_s = 0

[[tables]]
name = "replay"
capacity = 100
sampler = "prioritized"

[[tables]]
name = "declared"
capacity = 100
[tables.schema]
obs = "float32[3]"
"""


def test_reset_with_schema_takes_new_keys_which_survive_a_restart(tmp_path):
    config = CONFIG.format(checkpoints=tmp_path / "checkpoints")
    server = start_server(tmp_path, config)
    try:
        client = ReplayClient(server.address)
        old = client.insert("replay", {"obs": torch.randn(4, 3), "reward": torch.randn(4)})
        torchrl_rows = {"observation": torch.randn(2, 5), "next": {"reward": torch.randn(2, 1)}}
        with pytest.raises(errors.SchemaMismatchError) as refused:
            client.insert("replay", torchrl_rows)
        assert "client.reset('replay', schema=True)" in str(refused.value)
        assert client.info()["replay"].size == 4  # the refusal changed nothing

        client.reset("replay", schema=True)
        assert client.info()["replay"].schema == {}  # none until the next insert
        new = client.insert("replay", torchrl_rows)
        assert int(new.min()) > int(old.max())
        assert client.update_priorities("replay", old, torch.ones(4)) == 0  # stale
        assert client.info()["replay"].schema == {"observation": "float32[5]",
                                                  "next.reward": "float32[1]"}
        client.checkpoint()
        client.close()
    finally:
        assert server.stop() == 0
    restarted = start_server(tmp_path, config, name="restarted")
    try:
        client = ReplayClient(restarted.address)
        assert client.info()["replay"].size == 2
        assert client.sample("replay", 3).data["observation"].shape == (3, 5)
        client.close()
    finally:
        restarted.stop()


def test_reset_with_schema_keeps_the_declared_schema(tmp_path):
    server = start_server(tmp_path, CONFIG.format(checkpoints=tmp_path / "checkpoints"))
    try:
        client = ReplayClient(server.address)
        client.insert("declared", {"obs": torch.randn(2, 3)})
        client.reset("declared", schema=True)
        assert client.info()["declared"].schema == {"obs": "float32[3]"}
        with pytest.raises(errors.SchemaMismatchError, match="declared in the config"):
            client.insert("declared", {"observation": torch.randn(2, 3)})
        client.close()
    finally:
        server.stop()
