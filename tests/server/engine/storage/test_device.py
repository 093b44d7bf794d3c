"""Device tables (``device = "cuda"``) on the CPU stand-in: the same code path as on a GPU.

Without a GPU, :func:`~replay_server.engine.storage.placement.cpu_stand_in`
makes a ``"cuda"`` table allocate its columns with the device storage's own
torch calls on ``torch.device("cpu")``. Each test drives a device table and a
host table of the same config and seed with the same calls and compares
batches, ids, weights and probabilities bit for bit: what the device storage
changes (where rows live, how they are gathered) must change no result.
The refusals (no CUDA, no such device index, not enough device memory,
combinations not built) are checked with the stand-in saying so.
"""

from __future__ import annotations

import gc
import numpy as np
import pytest
import torch

from replay_server.engine.config import TableConfig
from replay_server.engine.inputs import columns_of
from replay_server.engine.memory import MemoryLedger
from replay_server.engine.table_memory import table_bytes
from replay_server.engine.schema import FieldSpec, Schema
from replay_server.engine.storage.device import DeviceColumn
from replay_server.engine.storage.placement import cpu_stand_in
from replay_server.engine.table import Table
from replay_server.errors import ConfigError, InsufficientMemoryError


@pytest.fixture
def stand_in():
    with cpu_stand_in() as machine:
        yield machine


def _pair(**options) -> tuple[Table, Table]:
    """A device table and a host table of the same config (and seed)."""
    base = dict(name="t", seed=7, **options)
    return Table(TableConfig(device="cuda", **base)), Table(TableConfig(**base))


def _rows(rng: np.random.Generator, n: int, start: int) -> dict[str, torch.Tensor]:
    return {
        "obs": torch.from_numpy(rng.integers(0, 255, (n, 3, 4), dtype=np.uint8)),
        "reward": torch.from_numpy(rng.standard_normal(n).astype(np.float32)),
        "half": torch.from_numpy(rng.standard_normal((n, 2)).astype(np.float32)).to(torch.bfloat16),
        "done": torch.from_numpy(rng.random(n) < 0.1),
        "row": torch.arange(start, start + n),
    }


def _same(a, b) -> None:
    assert a.columns.keys() == b.columns.keys()
    for key in a.columns:
        assert a.columns[key].dtype == b.columns[key].dtype, key
        assert torch.equal(a.columns[key], b.columns[key]), key
    for x, y in zip(a.extras, b.extras):
        assert x.dtype == y.dtype and torch.equal(x, y)


@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
def test_a_device_table_samples_exactly_as_a_host_table(stand_in, sampler):
    """Random inserts (wrapping the ring many times), samples and priority updates."""
    device, host = _pair(capacity=97, sampler=sampler)
    rng = np.random.default_rng(3)
    written = 0
    for step in range(60):
        n = int(rng.integers(1, 40))
        rows = _rows(rng, n, written)
        priorities = (torch.from_numpy(rng.random(n) * 5) if sampler == "prioritized"
                      and step % 2 else None)
        ids = device.insert(rows, priorities)
        assert torch.equal(ids, host.insert(rows, priorities))
        written += n
        batch, expected = device.sample(32), host.sample(32)
        _same(batch, expected)
        if sampler == "prioritized":
            new = torch.from_numpy(rng.random(32) * 3)
            assert device.update_priorities(batch.ids, new) == host.update_priorities(
                expected.ids, new)
    assert written > 10 * 97  # the ring wrapped many times
    assert all(isinstance(c, DeviceColumn) for c in device._parts.storage.columns.values())
    assert device.info().counters == host.info().counters


def test_a_device_queue_table_takes_and_deletes_like_a_host_one(stand_in):
    device, host = _pair(capacity=50, sampler="fifo")
    rng = np.random.default_rng(5)
    for step in range(30):
        rows = _rows(rng, int(rng.integers(1, 12)), step * 100)
        ids = device.insert(rows)
        assert torch.equal(ids, host.insert(rows))
        if step % 3 == 0:
            assert device.delete(ids[:2]) == host.delete(ids[:2])
        if device.size >= 4:
            _same(device.sample(4), host.sample(4))


def test_a_device_slice_table_with_retirement_matches_the_host_table(stand_in):
    device, host = _pair(capacity=64, sampler="slice", slice_len=4)
    rng = np.random.default_rng(9)
    for step in range(20):
        rows = _rows(rng, 10, step * 10)
        rows["episode"] = torch.full((10,), step // 2, dtype=torch.int64)
        device.insert(rows), host.insert(rows)
        _same(device.sample(6), host.sample(6))
    retiring, plain = _pair(capacity=40, max_times_sampled=2)
    for table in (retiring, plain):
        table.insert(_rows(np.random.default_rng(1), 40, 0))
    for _ in range(10):
        _same(retiring.sample(7), plain.sample(7))


def test_a_batch_without_out_is_wholly_on_the_device_and_host_out_gets_one_copy(stand_in):
    device, host = _pair(capacity=32, sampler="prioritized")
    rows = _rows(np.random.default_rng(2), 32, 0)
    device.insert(rows), host.insert(rows)
    storage = device._parts.storage
    on_device = device.sample(8)
    assert all(t.device == storage.device for t in on_device.tensors())
    _same(on_device, host.sample(8))
    layout = device.batch_layout(8)
    out = {key: torch.zeros(shape, dtype=dtype) for key, (dtype, shape) in layout.items()}
    batch, expected = device.sample(8, out=out), host.sample(8)
    _same(batch, expected)
    assert all(batch.columns[key] is out[key] for key in out)  # rows landed in the caller's buffers


def test_a_declared_schema_is_allocated_on_the_device_and_not_counted_in_host_memory(stand_in):
    schema = {"obs": FieldSpec(torch.uint8, (84, 84))}
    device_config = TableConfig(name="t", capacity=1000, device="cuda:0", schema=schema)
    host_config = TableConfig(name="t", capacity=1000, schema=schema)
    row = Schema(schema).row_bytes
    assert table_bytes(host_config, Schema(schema)) >= 1000 * row
    assert table_bytes(device_config, Schema(schema)) < 1000 * row  # sampler state only
    # A host ledger too small for the rows admits the device table: its rows are on the device.
    table = Table(device_config, memory=MemoryLedger(1000 * row // 2))
    assert table.info().storage_bytes == 1000 * row
    storage = table._parts.storage
    assert not storage.allocated and stand_in.allocated == 0  # checked at start, taken later
    table.insert({"obs": torch.zeros(2, 84, 84, dtype=torch.uint8)})
    assert storage.allocated and stand_in.allocated == 1000 * row
    assert all(col.device == torch.device("cpu") for col in storage.columns.values())


def test_columns_are_allocated_when_the_first_insert_needs_them_and_checked_again():
    schema = {"obs": FieldSpec(torch.uint8, (84, 84))}
    table_bytes_on_device = 100 * 84 * 84
    with cpu_stand_in(free_bytes=table_bytes_on_device + 1000) as machine:
        first = Table(TableConfig(name="a", capacity=100, device="cuda", schema=schema))
        second = Table(TableConfig(name="b", capacity=100, device="cuda", schema=schema))
        first.insert({"obs": torch.ones(3, 84, 84, dtype=torch.uint8)})  # takes the device
        with pytest.raises(InsufficientMemoryError, match=r"table 'b'.*device 'cuda'.*free"):
            second.insert({"obs": torch.ones(3, 84, 84, dtype=torch.uint8)})
        assert second.size == 0 and second.info().counters.inserted == 0  # nothing changed
        del first
        gc.collect()  # the table sits in reference cycles: collect it now
        second.insert({"obs": torch.ones(3, 84, 84, dtype=torch.uint8)})  # room again
        assert second.size == 3 and machine.allocated == table_bytes_on_device


def test_a_device_without_room_is_refused_naming_the_table_device_and_bytes():
    schema = {"obs": FieldSpec(torch.uint8, (84, 84))}
    with cpu_stand_in(free_bytes=1 << 20):
        with pytest.raises(ConfigError, match=r"table 't'.*on device 'cuda'.*1\.0 MiB free"):
            Table(TableConfig(name="t", capacity=1000, device="cuda", schema=schema))
        # Without a declared schema, the first insert is refused; nothing is stored.
        table = Table(TableConfig(name="t", capacity=1000, device="cuda"))
        with pytest.raises(InsufficientMemoryError, match=r"table 't'.*device 'cuda'"):
            table.insert({"obs": torch.zeros(3, 84, 84, dtype=torch.uint8)})
        assert table.size == 0 and table.schema is None
        small = {"obs": torch.zeros(3, 8, dtype=torch.uint8)}
        table.insert(small)  # 8 KB fits: the table works afterwards
        assert table.size == 3


def test_a_missing_device_is_refused_at_start_naming_table_and_device():
    with cpu_stand_in(devices=0):
        with pytest.raises(ConfigError, match=r"table 'g': device = 'cuda' but this machine has "
                                              r"no CUDA device"):
            Table(TableConfig(name="g", capacity=10, device="cuda"))
    with cpu_stand_in(devices=2):
        Table(TableConfig(name="g", capacity=10, device="cuda:1"))
        with pytest.raises(ConfigError, match=r"table 'g': device = 'cuda:2' but this machine "
                                              r"has 2 CUDA devices \(indices 0-1\)"):
            Table(TableConfig(name="g", capacity=10, device="cuda:2"))


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="this machine has a CUDA device")
def test_without_the_stand_in_a_cuda_table_is_refused_on_a_machine_without_cuda():
    with pytest.raises(ConfigError, match="table 'g': device = 'cuda' but this machine has no"):
        Table(TableConfig(name="g", capacity=10, device="cuda"))


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:-1", "cuda:01", "CUDA", 0, None])
def test_a_malformed_device_is_refused(device):
    with pytest.raises(ConfigError, match=r"table 't': device must be 'cpu', 'cuda' or 'cuda:N'"):
        TableConfig(name="t", capacity=10, device=device)


def test_rows_already_on_the_tables_device_stay_there_and_others_come_to_the_host():
    on_device = torch.empty(3, 2, device="meta")  # stands for rows made on the GPU
    columns = columns_of({"a": on_device, "b": np.zeros(3), "c": torch.empty(3, device="meta")},
                         "t", device=torch.device("meta"))
    assert columns["a"] is on_device and columns["c"].is_meta
    assert columns["b"].device.type == "cpu"
    with pytest.raises(NotImplementedError):  # a host table copies them out (meta cannot be)
        columns_of({"a": on_device}, "t")
