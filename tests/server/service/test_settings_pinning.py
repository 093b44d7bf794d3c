"""``pin_memory = "auto"`` on a CUDA host pins the tables that can be pinned, and only those."""

from __future__ import annotations

import pytest

from replay_server.engine.config import TableConfig
from replay_server.errors import ConfigError
from replay_server.service import settings as settings_module
from replay_server.service.settings import ServerSettings


def _tables(tmp_path) -> tuple[TableConfig, ...]:
    return (
        TableConfig(name="plain", capacity=10),
        TableConfig(name="mapped", capacity=10, storage="memmap", storage_dir=str(tmp_path)),
        TableConfig(name="packed", capacity=10, compress_keys=["obs"]),
    )


@pytest.fixture
def cuda_host(monkeypatch) -> None:
    monkeypatch.setattr(settings_module, "cuda_present", lambda: True)


def test_auto_pins_only_tables_whose_storage_can_be_pinned(tmp_path, cuda_host) -> None:
    resolved = ServerSettings(tables=_tables(tmp_path), pin_memory="auto").table_configs
    assert {t.name: t.pin_memory for t in resolved} == {
        "plain": True, "mapped": False, "packed": True}  # packed: its plain columns


def test_true_asks_every_table_and_names_the_one_that_cannot(tmp_path, cuda_host) -> None:
    with pytest.raises(ConfigError, match="mapped.*pin_memory"):
        ServerSettings(tables=_tables(tmp_path), pin_memory="true").table_configs


def test_without_cuda_auto_pins_nothing(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(settings_module, "cuda_present", lambda: False)
    resolved = ServerSettings(tables=_tables(tmp_path), pin_memory="auto").table_configs
    assert not any(t.pin_memory for t in resolved)
