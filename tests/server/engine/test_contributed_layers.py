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
class LabelOptions(SamplerSpec):
    label: str = option("plain", "a label the sampler reports in info")

    def check(self, where: str, capacity: int) -> None:
        if not isinstance(self.label, str) or not self.label:
            raise ConfigError(f"{where}: label must be a non-empty string, got {self.label!r}")


class LabelledSampler(UniformSampler):
    """Uniform draws, with a label: a sampler with one option of its own."""

    kind = "labelled"
    options = LabelOptions

    @classmethod
    def build(cls, ring: Any, options: Any, *, deletes: bool) -> LabelledSampler:
        sampler = super().build(ring, options, deletes=deletes)
        sampler.label = options.label  # type: ignore[attr-defined]
        return sampler  # type: ignore[return-value]

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "label": self.label}  # type: ignore[attr-defined]


@dataclass(frozen=True, kw_only=True)
class ShelfOptions(LayerSpec):
    shelf: str = option("top", "where the rows are shelved")


SHELF = Backend("shelf", ShelfOptions, "host memory on a named shelf",
                column=lambda spec, capacity, options: HostColumn(spec, capacity),
                column_class=HostColumn)


@pytest.fixture
def contributed():
    with ExitStack() as stack:
        stack.enter_context(SAMPLERS.registered("labelled", LabelledSampler))
        stack.enter_context(BACKENDS.registered("shelf", SHELF))
        yield


def test_the_matrix_plays_the_contributed_sampler_and_storage(contributed, tmp_path: Path):
    cells = every_combo()
    assert {c.sampler for c in cells} >= {"labelled", "uniform"}
    assert {c.storage for c in cells} >= {"shelf", "memory"}
    for combo in (Combo("labelled", "memory", True, True, 3),
                  Combo("prioritized", "shelf", True, False, 1),
                  Combo("labelled", "shelf", False, True, 1)):
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
    with SAMPLERS.registered("labelled", LabelledSampler):
        pass
    assert "labelled" not in {c.sampler for c in every_combo()}
    with pytest.raises(ConfigError, match="sampler must be one of"):
        TableConfig(name="t", capacity=8, sampler="labelled")


def test_info_reports_the_contributed_layers_options_and_capabilities(contributed):
    table = Table(TableConfig(name="t", capacity=8, sampler="labelled", label="mine",
                              storage="shelf", shelf="left"))
    info = table.info()
    assert (info.sampler, info.config["label"], info.config["shelf"]) == ("labelled", "mine",
                                                                          "left")
    assert info.config["storage"] == "shelf"
    assert info.sampler_stats["label"] == "mine"
    assert info.capabilities.priorities is False and info.capabilities.mergeable is True


def test_the_contributed_options_are_refused_elsewhere_naming_their_owner(contributed):
    with pytest.raises(ConfigError, match="label='x' is only used by sampler 'labelled', and "
                                          "sampler is 'uniform'"):
        TableConfig(name="t", capacity=8, label="x")
    with pytest.raises(ConfigError, match="shelf='x' is only used by storage 'shelf'"):
        TableConfig(name="t", capacity=8, shelf="x")
    with pytest.raises(ConfigError, match="label must be a non-empty string"):
        TableConfig(name="t", capacity=8, sampler="labelled", label="")


def test_check_config_reports_the_contributed_layers(contributed):
    settings = settings_from_dict({"tables": [
        {"name": "t", "capacity": 8, "sampler": "labelled", "label": "mine",
         "storage": "shelf", "shelf": "left"}]})
    report = config_report(settings)
    assert "samplers: uniform, prioritized, slice, prioritized_slice, fifo, lifo, labelled" \
        in report
    assert "storage: memory, memmap, shelf" in report
    assert "  t: labelled, capacity 8, storage=shelf, label=mine, shelf=left" in report.splitlines()
