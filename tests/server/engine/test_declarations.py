"""The torch-free declarations (what ``check-config`` reads) state what the implementations do.

Each built-in sampler is declared in ``engine/sampler_kinds.py`` and built from
its class; each storage backend's RAM is declared in ``engine/storage_kinds.py``
and allocated by its column class. These tests hold the two sides together.
"""

from __future__ import annotations

import pytest
import torch

from replay_server.engine.config import TableConfig
from replay_server.engine.sampler_kinds import SAMPLERS, DeclaredSampler
from replay_server.engine.schema import FieldSpec, Schema
from replay_server.engine.storage.compressed import Lz4Column
from replay_server.engine.storage.device import DeviceColumn
from replay_server.engine.storage.memmap import MemmapColumn
from replay_server.engine.storage.memory import HostColumn
from replay_server.engine.table_memory import storage_ram_bytes

BUILT_IN = [d for d in SAMPLERS.values() if isinstance(d, DeclaredSampler)]


def test_every_sampler_configs_name_is_declared() -> None:
    assert [d.kind for d in BUILT_IN] == ["uniform", "prioritized", "slice",
                                          "prioritized_slice", "fifo", "lifo"]


@pytest.mark.parametrize("declared", BUILT_IN, ids=lambda d: d.kind)
def test_each_declared_sampler_is_its_class(declared: DeclaredSampler) -> None:
    cls = declared.implementation
    assert (cls.kind, cls.options, cls.traits) == (declared.kind, declared.options,
                                                  declared.traits)
    options = declared.options(**({"slice_len": 4} if "slice_len" in declared.options.keys()
                                  else {}))
    for capacity in (10, 2**31):
        for deletes in (False, True):
            assert (cls.slot_bytes(options, capacity, deletes=deletes)
                    == declared.slot_bytes(options, capacity, deletes=deletes))


def _columns(config: TableConfig, schema: Schema) -> int:
    """What the column classes themselves say they take, column by column."""
    total = 0
    for key, spec in schema.items():
        if config.compress_keys and key in config.compress_keys:
            cls = Lz4Column
        elif config.backend_of(key) == "memmap":
            cls = MemmapColumn
        else:
            cls = DeviceColumn if config.on_device else HostColumn
        total += cls.ram_bytes(spec, config.capacity)
    return total


@pytest.mark.parametrize("options", [
    {}, {"storage": "memmap", "storage_dir": "."}, {"compress_keys": ["obs"]},
    {"column_storage": {"obs": "memmap"}, "storage_dir": "."}, {"device": "cuda"},
], ids=["memory", "memmap", "lz4", "mixed", "device"])
def test_the_declared_ram_of_each_backend_is_its_columns(options: dict) -> None:
    config = TableConfig(name="t", capacity=1000, **options)
    schema = Schema({"obs": FieldSpec(torch.uint8, (84, 84)), "reward": FieldSpec("float32")})
    assert storage_ram_bytes(config, schema) == _columns(config, schema)
    assert (storage_ram_bytes(config, schema) > 0) == (options in ({}, {"compress_keys": ["obs"]})
                                                       or "column_storage" in options)


def test_a_field_spec_is_the_same_given_a_name_or_a_dtype() -> None:
    by_dtype, by_name = FieldSpec(torch.bfloat16, (3,)), FieldSpec("bfloat16", (3,))
    assert by_dtype == by_name and hash(by_dtype) == hash(by_name)
    assert by_name.dtype is torch.bfloat16 and by_name.row_bytes == 6
    with pytest.raises(ValueError, match="unknown dtype name 'complex64'"):
        FieldSpec("complex64")
    with pytest.raises(ValueError, match="dtype torch.complex64 is not supported"):
        FieldSpec(torch.complex64)


@pytest.mark.parametrize("capacity", [1, 2**31 - 1, 2**31])
def test_the_declared_index_and_count_sizes_are_numpys(capacity: int) -> None:
    import numpy as np

    from replay_server.engine.slot_memory import (
        count_dtype,
        index_bytes,
        index_dtype,
        remover_slot_bytes,
    )

    assert index_bytes(capacity) == np.dtype(index_dtype(capacity)).itemsize
    for limit in (1, 255, 256, 65_535, 65_536, 2**32 - 1):
        assert remover_slot_bytes(limit) == np.dtype(count_dtype(limit)).itemsize
        assert np.iinfo(count_dtype(limit)).max >= limit
    with pytest.raises(ValueError, match="exceeds uint32"):
        count_dtype(2**32)
