"""incarnation: the durable id incarnation counter of a checkpoint directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from replay_proto.id_layout import MAX_INCARNATION
from replay_server.checkpoint.incarnation import INCARNATION_NAME, IncarnationFile
from replay_server.errors import ConfigError


def test_each_claim_takes_the_next_incarnation_and_writes_it_first(tmp_path: Path) -> None:
    first = IncarnationFile.claim(tmp_path, shard=2)
    assert (first.current, first.shard) == (1, 2)
    assert (tmp_path / INCARNATION_NAME).read_text() == "1\n"
    assert IncarnationFile.claim(tmp_path, shard=2).current == 2
    assert (tmp_path / INCARNATION_NAME).stat().st_mode & 0o777 == 0o600
    assert not (tmp_path / (INCARNATION_NAME + ".tmp")).exists()


def test_advance_writes_a_new_incarnation_above_a_floor(tmp_path: Path) -> None:
    counter = IncarnationFile.claim(tmp_path, shard=0)
    assert counter.advance(40) == 41
    assert counter.current == 41 and (tmp_path / INCARNATION_NAME).read_text() == "41\n"
    assert IncarnationFile.claim(tmp_path, shard=0).current == 42


@pytest.mark.parametrize("text", ["", "seven\n", "-3\n", "70000\n"])
def test_an_unreadable_counter_stops_the_start(tmp_path: Path, text: str) -> None:
    (tmp_path / INCARNATION_NAME).write_text(text)
    with pytest.raises(ConfigError, match="should hold the last id incarnation"):
        IncarnationFile.claim(tmp_path, shard=0)
    assert (tmp_path / INCARNATION_NAME).read_text() == text  # untouched


def test_a_used_up_counter_stops_the_start(tmp_path: Path) -> None:
    (tmp_path / INCARNATION_NAME).write_text(f"{MAX_INCARNATION}\n")
    with pytest.raises(ConfigError, match="all 65,535 id incarnations are used up"):
        IncarnationFile.claim(tmp_path, shard=0)


def test_an_unwritable_directory_stops_the_start(tmp_path: Path) -> None:
    missing = tmp_path / "gone"
    with pytest.raises(ConfigError, match="cannot write"):
        IncarnationFile.claim(missing, shard=0)
