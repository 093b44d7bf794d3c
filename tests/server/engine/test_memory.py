"""memory: what a table costs, and the ledger that keeps a server's tables within a limit."""

from __future__ import annotations

import pytest
import torch

from replay_server import FieldSpec, Schema, Table, TableConfig, TableSet
from replay_server.engine.memory import MemoryLedger, format_bytes, machine_memory
from replay_server.engine.table_memory import sampler_slot_bytes, table_bytes
from replay_server.errors import ConfigError, InsufficientMemoryError


def config(**kwargs) -> TableConfig:
    return TableConfig(**{"name": "t", "capacity": 1000, **kwargs})


def test_a_table_costs_its_rows_at_capacity_plus_its_sampler_state() -> None:
    schema = Schema({"obs": FieldSpec(torch.float32, (4,)), "done": FieldSpec(torch.bool)})
    assert table_bytes(config(), schema) == 1000 * 17
    assert table_bytes(config(), None) == 0  # uniform, no schema yet: nothing per slot
    assert sampler_slot_bytes(config(sampler="prioritized")) > 0
    assert sampler_slot_bytes(config(sampler="slice", slice_len=2)) == 12
    assert sampler_slot_bytes(config(max_times_sampled=1)) == 8 + 1  # drawable set, uint8 count
    assert sampler_slot_bytes(config(max_times_sampled=300)) == 8 + 2
    assert sampler_slot_bytes(config(sampler="fifo")) == 1  # runs: nothing per row; the count


def test_the_machine_has_some_memory_and_bytes_read_well() -> None:
    assert machine_memory() > 1 << 28
    assert format_bytes(512) == "512 B" and format_bytes(3 << 30) == "3.0 GiB"


def test_the_ledger_holds_one_promise_per_table_and_refuses_past_its_limit() -> None:
    ledger = MemoryLedger(1000, "server.table_memory_mb")
    ledger.require("a", 600, "a's rows")
    ledger.require("a", 700, "a's rows")  # replaces a's promise
    assert ledger.committed == 700
    with pytest.raises(InsufficientMemoryError) as info:
        ledger.require("b", 400, "b's rows")
    assert "table 'b': b's rows needs 400 B" in str(info.value)
    assert "server.table_memory_mb allows (1000 B)" in str(info.value)
    assert "the other tables hold 700 B" in str(info.value)
    assert ledger.committed == 700


def test_a_first_insert_too_large_for_the_ledger_is_refused_and_changes_nothing() -> None:
    ledger = MemoryLedger(100_000)
    table = Table(config(), memory=ledger)
    with pytest.raises(InsufficientMemoryError, match=r"capacity 1,000 x 400 bytes per row"):
        table.insert({"obs": torch.zeros(2, 100)})
    assert table.schema is None and table.size == 0 and ledger.committed == 0
    assert table.insert({"obs": torch.zeros(2, 10)}).tolist() == [0, 1]
    assert ledger.committed == 40_000


def test_tables_of_a_set_share_the_ledger_and_a_declared_schema_is_checked_at_start() -> None:
    schema = {"obs": FieldSpec(torch.float32, (10,))}
    configs = [config(name="a", schema=schema), config(name="b", schema=schema)]
    assert TableSet(configs, memory=MemoryLedger(80_000)).memory.committed == 80_000
    with pytest.raises(ConfigError, match="table 'b': capacity 1,000 \\(sampler state and the "
                                          "declared schema\\) needs 39.1 KiB"):
        TableSet(configs, memory=MemoryLedger(79_999))


def test_a_state_whose_schema_does_not_fit_is_refused_on_load() -> None:
    source = Table(config())
    source.insert({"obs": torch.zeros(3, 100)})
    target = Table(config(), memory=MemoryLedger(1000))
    with pytest.raises(InsufficientMemoryError, match="the saved schema"):
        target.load_state_dict(source.state_dict())
    assert target.schema is None
