"""Named variables in checkpoints: saved and restored, older checkpoints without them still load,
a damaged part makes the checkpoint skipped like any damaged one."""

from __future__ import annotations

import json

import torch

from replay_server import TableConfig, TableSet
from replay_server.checkpoint import CheckpointDirectory, write_checkpoint
from replay_server.checkpoint.manifest import MANIFEST, VARIABLES_FILE
from replay_server.checkpoint.reader import restore_latest
from replay_server.engine.variables import VariableStore

CONFIGS = [TableConfig(name="t", capacity=10)]


def write(directory: CheckpointDirectory, variables: VariableStore | None):
    tables = TableSet(CONFIGS)
    tables["t"].insert({"x": torch.arange(4.0)})
    return write_checkpoint(tables, directory, keep_latest=5, server_version="test",
                            variables=variables)


def restore(directory: CheckpointDirectory):
    return restore_latest(directory, lambda: TableSet(CONFIGS),
                          make_variables=lambda: VariableStore(1 << 20))


def store_with_policy(value: float) -> VariableStore:
    store = VariableStore(1 << 20)
    store.publish("policy", {"w": torch.full((3,), value), "n": torch.tensor([1], dtype=torch.int32)})
    store.publish("policy", {"w": torch.full((3,), value + 1), "n": torch.tensor([2], dtype=torch.int32)})
    return store


def test_variables_round_trip_with_their_versions(directory) -> None:
    write(directory, store_with_policy(1.0))
    tables, result = restore(directory)
    got = result.variables.get("policy")
    assert got.version == 2 and torch.equal(got.tensors["w"], torch.full((3,), 2.0))
    assert got.tensors["n"].dtype == torch.int32
    assert tables["t"].size == 4
    manifest = json.loads((result.path / MANIFEST).read_text())
    assert manifest["variables"]["version"] == 2
    assert manifest["variables"]["file"]["name"] == VARIABLES_FILE


def test_a_checkpoint_without_variables_still_loads_with_none(directory) -> None:
    result = write(directory, None)  # as servers before named variables wrote them
    assert "variables" not in json.loads((result.path / MANIFEST).read_text())
    tables, restored = restore(directory)
    assert restored.variables.names() == [] and tables["t"].size == 4


def test_a_damaged_variables_file_makes_the_checkpoint_skipped(directory) -> None:
    older = write(directory, store_with_policy(1.0))
    newer = write(directory, store_with_policy(5.0))
    data = bytearray((newer.path / VARIABLES_FILE).read_bytes())
    data[0] ^= 0xFF
    (newer.path / VARIABLES_FILE).write_bytes(bytes(data))
    _, result = restore(directory)
    assert result.path == older.path
    assert result.skipped and "variables.bin" in result.skipped[0][1]
    assert torch.equal(result.variables.get("policy").tensors["w"], torch.full((3,), 2.0))


def test_a_variables_part_of_a_newer_layout_is_not_half_used(directory) -> None:
    older = write(directory, store_with_policy(1.0))
    newer = write(directory, store_with_policy(5.0))
    from replay_server.checkpoint.manifest import complete_marker
    doc = json.loads((newer.path / MANIFEST).read_text())
    doc["variables"]["version"] = 99
    data = json.dumps(doc).encode()
    (newer.path / MANIFEST).write_bytes(data)
    (newer.path / "COMPLETE").write_bytes(complete_marker(data))
    _, result = restore(directory)
    assert result.path == older.path and "layout version 99" in result.skipped[0][1]


def test_a_checkpoint_of_layout_1_still_restores(directory) -> None:
    """Checkpoints written before variables were held packed (layout 1) keep restoring."""
    from replay_server.checkpoint.manifest import complete_marker
    from replay_server.checkpoint.fileio import write_file
    from replay_server.checkpoint.statecodec import encode_state
    result = write(directory, store_with_policy(1.0))
    tree, blob = encode_state(store_with_policy(1.0).state_dict())
    (result.path / VARIABLES_FILE).unlink()
    file = write_file(result.path, VARIABLES_FILE, *blob)
    doc = json.loads((result.path / MANIFEST).read_text())
    doc["variables"] = {"version": 1, "state": tree, "file": file.to_json()}
    data = json.dumps(doc).encode()
    (result.path / MANIFEST).write_bytes(data)
    (result.path / "COMPLETE").write_bytes(complete_marker(data))
    _, restored = restore(directory)
    got = restored.variables.get("policy")
    assert restored.path == result.path and got.version == 2
    assert torch.equal(got.tensors["w"], torch.full((3,), 2.0))


def test_a_variable_of_many_keys_round_trips_packed(directory) -> None:
    store = VariableStore(1 << 30)
    many = {f"k{i}": torch.full((1,), float(i)) for i in range(20_000)}
    store.publish("many", many)
    write(directory, store)
    _, result = restore(directory)
    got = result.variables.get("many")
    assert got.keys == 20_000 and got.nbytes == store.get("many").nbytes
    assert got.tensors["k19999"].item() == 19999.0
