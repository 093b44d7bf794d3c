"""A contributor's check: a sampler and a storage backend defined and registered here, in the
test package, with no product file edited, are configs' kinds with their own option: the
composition matrix plays them, ``check-config`` reports them, and ``info`` reports their
capabilities and options.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from replay_server.app.config_file import settings_from_dict
from replay_server.app.config_report import config_report
from replay_server.engine.config import TableConfig
from replay_server.engine.options import LayerSpec, option
from replay_server.engine.samplers import SAMPLERS, SamplerSpec, UniformSampler
from replay_server.engine.storage.backends import BACKENDS, Backend
from replay_server.engine.storage.memory import HostColumn
from replay_server.engine.table import Table
from replay_server.errors import ConfigError
from tests.server.engine.composition import Combo, Run, every_combo


@dataclass(frozen=True, kw_only=True)
class TagOptions(SamplerSpec):
    tag: int = option(0, "a number the sampler reports in info")

    def check(self, where: str, capacity: int) -> None:
        if not isinstance(self.tag, int) or isinstance(self.tag, bool) or self.tag < 0:
            raise ConfigError(f"{where}: tag must be an integer >= 0, got {self.tag!r}")


class TaggedSampler(UniformSampler):
    """Uniform draws, with a tag: a sampler with one option of its own."""

    kind = "tagged"
    options = TagOptions

    @classmethod
    def build(cls, ring: Any, options: Any, *, deletes: bool) -> TaggedSampler:
        sampler = super().build(ring, options, deletes=deletes)
        sampler.tag = options.tag  # type: ignore[attr-defined]
        return sampler  # type: ignore[return-value]

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "tag": float(self.tag)}  # type: ignore[attr-defined]


@dataclass(frozen=True, kw_only=True)
class ShelfOptions(LayerSpec):
    shelf: str = option("top", "where the rows are shelved")


SHELF = Backend("shelf", ShelfOptions, "host memory on a named shelf",
                column=lambda spec, capacity, options: HostColumn(spec, capacity),
                column_class=HostColumn)


@pytest.fixture
def contributed():
    with ExitStack() as stack:
        stack.enter_context(SAMPLERS.registered("tagged", TaggedSampler))
        stack.enter_context(BACKENDS.registered("shelf", SHELF))
        yield


def test_the_matrix_plays_the_contributed_sampler_and_storage(contributed, tmp_path: Path):
    cells = every_combo()
    assert {c.sampler for c in cells} >= {"tagged", "uniform"}
    assert {c.storage for c in cells} >= {"shelf", "memory"}
    for combo in (Combo("tagged", "memory", True, True, 3),
                  Combo("prioritized", "shelf", True, False, 1),
                  Combo("tagged", "shelf", False, True, 1)):
        assert combo in cells
        run = Run(combo, tmp_path, seed=1)
        try:
            run.play(60)
            run.insert(8)
            run.sample(4)
            assert run.checked >= 1
        finally:
            run.close()


def test_the_contributed_layers_leave_with_their_registration():
    with SAMPLERS.registered("tagged", TaggedSampler):
        pass
    assert "tagged" not in {c.sampler for c in every_combo()}
    with pytest.raises(ConfigError, match="sampler must be one of"):
        TableConfig(name="t", capacity=8, sampler="tagged")


def test_a_configs_description_follows_the_layers_registered_as_they_come_and_go():
    """``describe`` (every ``info``) keeps its keys between calls, but a layer registered
    or removed since changes them."""
    plain = TableConfig(name="t", capacity=8)
    assert "tag" not in plain.describe()
    with SAMPLERS.registered("tagged", TaggedSampler):
        assert plain.describe()["tag"] == 0  # a layer the table lacks: its default
        assert TableConfig(name="t", capacity=8, sampler="tagged", tag=5).describe()["tag"] == 5
    assert "tag" not in plain.describe()


def test_info_reports_the_contributed_layers_options_and_capabilities(contributed):
    table = Table(TableConfig(name="t", capacity=8, sampler="tagged", tag=7,
                              storage="shelf", shelf="left"))
    info = table.info()
    assert (info.sampler, info.config["tag"], info.config["shelf"]) == ("tagged", 7, "left")
    assert info.config["storage"] == "shelf"
    assert info.sampler_stats["tag"] == 7.0
    assert info.capabilities.priorities is False and info.capabilities.mergeable is True


def test_the_contributed_options_are_refused_elsewhere_naming_their_owner(contributed):
    with pytest.raises(ConfigError, match="tag=3 is only used by sampler 'tagged', and "
                                          "sampler is 'uniform'"):
        TableConfig(name="t", capacity=8, tag=3)
    with pytest.raises(ConfigError, match="shelf='x' is only used by storage 'shelf'"):
        TableConfig(name="t", capacity=8, shelf="x")
    with pytest.raises(ConfigError, match="tag must be an integer >= 0, got -1"):
        TableConfig(name="t", capacity=8, sampler="tagged", tag=-1)


def test_check_config_reports_the_contributed_layers(contributed):
    settings = settings_from_dict({"tables": [
        {"name": "t", "capacity": 8, "sampler": "tagged", "tag": 7,
         "storage": "shelf", "shelf": "left"}]})
    report = config_report(settings)
    assert "samplers: uniform, prioritized, slice, prioritized_slice, fifo, lifo, tagged" \
        in report
    assert "storage: memory, memmap, shelf" in report
    assert "  t: tagged, capacity 8, storage=shelf, tag=7, shelf=left" in report.splitlines()


def test_a_server_serves_the_contributed_layers_and_info_reports_them(contributed):
    """Through a real server (in this process, where they are registered) and a real client:
    ``Info`` carries the sampler's name, the figure its option sets and the capabilities its
    traits declare (the options themselves are the in-process ``TableInfo.config``, above)."""
    from replay_client import ReplayClient
    from replay_server.app.embedded import EmbeddedServer

    settings = settings_from_dict({"server": {"address": "127.0.0.1:0"}, "tables": [
        {"name": "t", "capacity": 8, "sampler": "tagged", "tag": 7,
         "storage": "shelf", "shelf": "left"}]})
    with EmbeddedServer(settings) as server:
        client = ReplayClient(server.address)
        try:
            client.insert("t", {"x": torch.arange(5.0)})
            info = client.info()["t"]
            assert info.sampler == "tagged" and info.size == 5
            assert info.sampler_stats["tag"] == 7.0
            assert not info.capabilities.priorities and not info.capabilities.slices
            assert client.sample("t", batch_size=4).ids.shape == (4,)
        finally:
            client.close()
