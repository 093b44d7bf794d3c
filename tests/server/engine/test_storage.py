"""Column storage: every supported dtype round-trips, wrapping writes, strided inputs."""

from __future__ import annotations

import pytest
import torch

from replay_proto.dtypes import DTYPES
from replay_server.engine.schema import FieldSpec, Schema
from replay_server.engine.storage import ColumnStorage
from replay_server.engine.storage.memory import HostColumn


def in_memory(schema: Schema, capacity: int, *, pin_memory: bool = False) -> ColumnStorage:
    """Every column of ``schema`` in RAM (pinned with ``pin_memory``), prefaulted unless pinned."""
    columns = {key: HostColumn(spec, capacity, pin_memory=pin_memory)
               for key, spec in schema.items()}
    return ColumnStorage(schema, capacity, columns, prefault=[] if pin_memory else list(schema))


@pytest.mark.parametrize("name", list(DTYPES))
def test_every_supported_dtype_round_trips(name):
    dtype = DTYPES[name]
    storage = in_memory(Schema({"x": FieldSpec(dtype, (2,))}), capacity=8)
    rows = (torch.arange(12).reshape(6, 2) % 3).to(dtype)
    storage.write(5, {"x": rows})  # slots 5, 6, 7, 0, 1, 2
    got = storage.gather(torch.tensor([[5, 6, 7], [0, 1, 2]]))["x"]
    assert got.dtype == dtype and got.shape == (2, 3, 2)
    assert torch.equal(got.reshape(6, 2), rows)


def test_strided_and_grad_requiring_inputs_are_copied_as_values():
    storage = in_memory(Schema({"x": FieldSpec(torch.float32, ())}), capacity=4)
    source = torch.arange(8, dtype=torch.float32, requires_grad=True)
    storage.write(0, {"x": source[::2]})
    assert storage.gather(torch.arange(4))["x"].tolist() == [0.0, 2.0, 4.0, 6.0]


def test_gather_returns_copies_not_views_of_storage():
    storage = in_memory(Schema({"x": FieldSpec(torch.int64, ())}), capacity=4)
    storage.write(0, {"x": torch.arange(4)})
    got = storage.gather(torch.tensor([1]))["x"]
    storage.write(1, {"x": torch.tensor([99])})
    assert got.tolist() == [1]


def test_pin_memory_without_an_accelerator_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("an accelerator is present")
    from replay_server.errors import ConfigError

    with pytest.raises(ConfigError, match="pin_memory is true but no CUDA device"):
        in_memory(Schema({"x": FieldSpec(torch.float32, ())}), capacity=4, pin_memory=True)


def test_writes_and_gathers_split_across_threads_equal_one_thread(monkeypatch):
    from replay_server.engine.storage import base as storage_module
    from replay_server.engine import workers

    monkeypatch.setattr(storage_module, "PARALLEL_BYTES", 64)
    monkeypatch.setattr(workers, "PARALLEL_BYTES", 64)
    monkeypatch.setattr(workers, "THREADS", 3)
    monkeypatch.setattr(storage_module, "WRITE_THREADS", 3)
    schema = Schema({"obs": FieldSpec(torch.uint8, (5, 3)), "reward": FieldSpec(torch.float32, ())})
    split, plain = in_memory(schema, capacity=50), in_memory(schema, capacity=50)
    generator = torch.Generator().manual_seed(0)
    for first, rows in ((0, 40), (40, 33), (23, 7)):  # the second write wraps
        data = {"obs": torch.randint(0, 255, (rows, 5, 3), dtype=torch.uint8, generator=generator),
                "reward": torch.randn(rows, generator=generator)}
        split.write(first, data)
        with monkeypatch.context() as single:
            single.setattr(storage_module, "PARALLEL_BYTES", 1 << 40)
            single.setattr(workers, "PARALLEL_BYTES", 1 << 40)
            plain.write(first, data)
    slots = torch.randint(0, 50, (37,), generator=generator).numpy()
    gathered = split.gather(slots)
    for key, column in plain.gather(slots).items():
        assert torch.equal(gathered[key], column)
    assert all(torch.equal(split.columns[k].tensor, plain.columns[k].tensor) for k in schema)
    assert workers._pool is not None  # the split path ran
