"""Compressed columns: the same batches as the uncompressed table, through wrap-around and
reloads; the ratio in info; the memory promised; bad options refused."""

from __future__ import annotations

import pytest
import torch

from replay_server.engine.config import TableConfig
from replay_server.engine.memory import MemoryLedger
from replay_server.engine.table_memory import table_bytes
from replay_server.engine.schema import FieldSpec, Schema
from replay_server.engine.table import Table
from replay_server.errors import ConfigError, InsufficientMemoryError, SchemaMismatchError


def rows(first: int, n: int) -> dict:
    t = torch.arange(first, first + n)
    frames = (t.view(n, 1, 1) // 4 + torch.arange(84).view(1, 1, 84)).to(torch.uint8)
    return {"obs": frames.expand(n, 84, 84).contiguous(), "reward": t.float(),
            "half": torch.randn(n, 3, generator=torch.Generator().manual_seed(first)).to(
                torch.bfloat16)}


@pytest.mark.parametrize("sampler", ["uniform", "prioritized", "fifo"])
def test_batches_equal_the_uncompressed_table_across_wrap_around_and_reloads(sampler) -> None:
    common = {"name": "t", "capacity": 40, "seed": 4, "sampler": sampler}
    plain, packed = Table(TableConfig(**common)), Table(
        TableConfig(**common, compress_keys=["obs", "half"]))
    for first in range(0, 130, 13):  # the ring wraps three times
        for table in (plain, packed):
            table.insert(rows(first, 13))
        if first == 52:
            reloaded = Table(packed.config)
            reloaded.load_state_dict(packed.state_dict())
            packed = reloaded
            reloaded = Table(plain.config)
            reloaded.load_state_dict(plain.state_dict())
            plain = reloaded
        a, b = plain.sample(8), packed.sample(8)
        assert torch.equal(a.ids, b.ids)
        for key in ("obs", "reward", "half"):
            assert torch.equal(a.data[key], b.data[key]), key
    ratio = packed.info().sampler_stats["compression_ratio"]
    assert ratio > 10  # these frames are highly regular
    assert packed.info().storage_bytes < plain.info().storage_bytes / 5


def test_compressed_rows_are_promised_as_they_are_stored_and_a_refused_insert_stores_nothing(
        ) -> None:
    """The ledger is promised the compressed blocks' segments as an insert takes them; one it
    cannot give refuses the insert whole."""
    schema = {"obs": FieldSpec(torch.uint8, (84, 84))}
    packed = TableConfig(name="t", capacity=100, compress_keys=["obs"], schema=schema)
    assert table_bytes(packed, Schema(schema)) == 100 * 12  # the blocks' offsets and lengths
    ledger = MemoryLedger(200_000)
    table = Table(packed, memory=ledger)
    regular = rows(0, 50)["obs"]  # compresses about 20x
    table.insert({"obs": regular})
    promised = ledger.committed
    assert 100 * 12 < promised < 100 * 84 * 84 / 4
    noise = torch.randint(0, 255, (60, 84, 84), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(1))  # incompressible
    with pytest.raises(InsufficientMemoryError, match="compressed rows"):
        table.insert({"obs": noise})
    assert table.size == 50 and ledger.committed == promised  # nothing of it stored
    batch = table.sample(20)
    assert torch.equal(batch.data["obs"], regular[batch.ids])


@pytest.mark.parametrize("fields, named", [
    ({"compress_keys": []}, "non-empty list"),
    ({"compress_keys": ["obs", "obs"]}, "distinct"),
])
def test_bad_compression_options_are_refused(fields: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        TableConfig(name="t", capacity=8, **fields)


def test_a_compressed_key_the_schema_lacks_is_refused_at_the_first_insert() -> None:
    table = Table(TableConfig(name="t", capacity=8, compress_keys=["pixels"]))
    with pytest.raises(SchemaMismatchError, match=r"compress_keys names \['pixels'\]"):
        table.insert(rows(0, 2))
    assert table.size == 0 and table.schema is None
