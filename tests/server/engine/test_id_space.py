"""id_space: shard | incarnation | sequence ids over segments, and how an id is classified."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replay_proto.id_layout import MAX_INCARNATION, make_id
from replay_server import Table, TableConfig
from replay_server.engine.id_space import IdSpace
from replay_server.engine.incarnations import LocalIncarnations, RandomIncarnations
from replay_server.errors import ConfigError, InvalidIdsError
from tests.proto.test_id_layout import split_id


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def space(shard: int = 0, incarnation: int = 0, segment_rows: int = 1 << 40) -> IdSpace:
    result = IdSpace(LocalIncarnations(shard, incarnation), segment_rows)
    result.begin(0)
    return result


def test_the_layout_puts_shard_incarnation_and_sequence_in_their_bits() -> None:
    row_id = make_id(127, MAX_INCARNATION, (1 << 40) - 1)
    assert row_id == 2**63 - 1  # the largest int64: every id is non-negative
    assert split_id(row_id) == (127, MAX_INCARNATION, (1 << 40) - 1)
    assert split_id(make_id(3, 17, 5)) == (3, 17, 5)


def test_an_in_process_table_numbers_its_rows_from_zero() -> None:
    table = Table(TableConfig(name="t", capacity=4))
    assert table.insert({"x": torch.zeros(3)}).tolist() == [0, 1, 2]


def test_the_current_segment_maps_positions_to_ids_by_one_add() -> None:
    s = space(shard=2, incarnation=9)
    base = make_id(2, 9, 0)
    assert s.id_of(5) == base + 5
    assert s.ids_of(ids(0, 3, 7), lowest=0).tolist() == [base, base + 3, base + 7]
    assert s.positions_of(ids(base + 1, base + 4), next_position=5, table="t").tolist() == [1, 4]


@pytest.mark.parametrize(("bad", "message"), [
    (-5, "-5 is not an id"),
    (make_id(4, 9, 1), "belongs to shard 4, and this server is shard 2"),
    (make_id(2, 9, 5), "was never issued by this table (incarnation 9 has issued sequences 0..4"),
])
def test_an_id_that_cannot_be_ours_is_invalid(bad: int, message: str) -> None:
    s = space(shard=2, incarnation=9)
    with pytest.raises(InvalidIdsError) as info:
        s.positions_of(ids(make_id(2, 9, 0), bad), next_position=5, table="t")
    assert message in str(info.value)


def restored(shard: int = 0) -> tuple[IdSpace, LocalIncarnations]:
    """A table saved at position 10 in incarnation 4 (restored once before, at position 6
    from incarnation 3), now restored by a run of incarnation 7."""
    saved = {"shard": shard, "segments": [[3, 0, 6], [4, 6, -1]]}
    source = LocalIncarnations(shard, 7)
    result = IdSpace(source)
    result.begin(0)
    result.load(saved, next_position=10, table="t")
    return result, source


def test_a_restore_keeps_the_segments_and_begins_a_new_one_where_the_ring_stopped() -> None:
    s, _ = restored()
    assert s.segments == [(3, 0, 6), (4, 6, 10), (7, 10, None)]
    assert s.id_of(10) == make_id(0, 7, 0)
    # Old rows keep their ids: positions 2 and 8 were issued by incarnations 3 and 4.
    assert s.ids_of(ids(2, 8, 11), lowest=0).tolist() == [
        make_id(0, 3, 2), make_id(0, 4, 2), make_id(0, 7, 1)]
    assert s.positions_of(ids(make_id(0, 3, 2), make_id(0, 4, 2), make_id(0, 7, 1)),
                          next_position=12, table="t").tolist() == [2, 8, 11]


def test_ids_lost_in_a_crash_or_of_unknown_runs_are_stale_not_errors() -> None:
    s, _ = restored()
    lost = make_id(0, 4, 4)  # incarnation 4 issued it after its last checkpoint (position 10)
    crashed = make_id(0, 5, 0)  # a run that never wrote a checkpoint
    far = make_id(0, 3, 6)  # beyond where incarnation 3's segment ended
    assert s.positions_of(ids(lost, crashed, far), next_position=12, table="t").tolist() == [
        -1, -1, -1]


def test_a_restored_segment_of_the_current_incarnation_is_never_reused() -> None:
    saved = {"shard": 0, "segments": [[7, 0, -1]]}  # an INCARNATION counter that went back
    source = LocalIncarnations(0, 7)
    s = IdSpace(source)
    s.begin(0)
    s.load(saved, next_position=3, table="t")
    assert s.incarnation == 8 and source.current == 8
    assert s.segments == [(7, 0, 3), (8, 3, None)]


def test_a_state_saved_by_another_shard_is_a_config_error() -> None:
    s = space(shard=1)
    with pytest.raises(ConfigError, match="config says shard=1 but the saved state has shard=0"):
        s.load({"shard": 0, "segments": [[0, 0, -1]]}, next_position=4, table="t")


def test_a_state_saved_before_segments_existed_reads_as_incarnation_zero() -> None:
    s = space(incarnation=5)
    s.load(None, next_position=4, table="t")
    assert s.segments == [(0, 0, 4), (5, 4, None)]
    assert s.positions_of(ids(2), next_position=4, table="t").tolist() == [2]


@pytest.mark.parametrize("segments", [
    [[1, 0, 5], [2, 6, -1]],    # a gap
    [[1, 0, 5], [1, 5, -1]],    # an incarnation twice
    [[70000, 0, -1]],           # out of range
    [[1, 0, 20], [2, 20, -1]],  # past the ring
    [[1, 0, 8]],                # the last one closed
    [],
])
def test_malformed_segments_are_refused(segments: list) -> None:
    with pytest.raises(ValueError):
        space().load({"shard": 0, "segments": segments}, next_position=10, table="t")


def test_a_full_segment_rolls_over_to_a_new_incarnation() -> None:
    source = LocalIncarnations(0, 2)
    s = IdSpace(source, segment_rows=8)
    s.begin(0)
    s.reserve(0, 5)
    s.reserve(5, 3)  # exactly full: still the first segment
    assert s.incarnation == 2
    s.reserve(8, 1)
    assert s.incarnation == 3 and s.segments == [(2, 0, 8), (3, 8, None)]
    assert s.id_of(8) == make_id(0, 3, 0)
    assert s.ids_of(ids(7, 9), lowest=0).tolist() == [make_id(0, 2, 7), make_id(0, 3, 1)]


def test_ids_of_many_segments_match_a_plain_reference() -> None:
    rng = np.random.default_rng(0)
    source = LocalIncarnations(5, 1)
    s = IdSpace(source, segment_rows=50)
    s.begin(0)
    position = 0
    while position < 1000:
        n = int(rng.integers(1, 20))
        s.reserve(position, n)
        position += n
    positions = rng.integers(0, position, 5000)
    expected = []
    for p in positions.tolist():
        incarnation, first, _ = next(seg for seg in reversed(s.segments) if seg[1] <= p)
        expected.append(make_id(5, incarnation, p - first))
    got = s.ids_of(positions, lowest=0)
    assert got.tolist() == expected
    assert s.positions_of(got, next_position=position, table="t").tolist() == positions.tolist()


def test_a_table_rolls_over_and_keeps_every_row_addressable(monkeypatch) -> None:
    monkeypatch.setattr(IdSpace.__init__, "__defaults__", (4,))  # 4 rows per segment
    table = Table(TableConfig(name="t", capacity=10, sampler="prioritized"))
    issued = torch.cat([table.insert({"row": torch.arange(k, k + 3)}) for k in range(0, 9, 3)])
    assert [split_id(i)[1:] for i in issued.tolist()] == [
        (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]
    batch = table.sample(200)
    assert torch.equal(issued[batch.data["row"]], batch.ids)
    assert table.update_priorities(issued, torch.ones(9)) == 9


def test_incarnations_run_out_with_a_clear_error() -> None:
    source = LocalIncarnations(0, MAX_INCARNATION)
    with pytest.raises(ConfigError, match="all 65,535 id incarnations are used up"):
        source.advance(0)


def test_a_non_persistent_server_draws_a_random_nonzero_incarnation() -> None:
    drawn = {RandomIncarnations(0).current for _ in range(50)}
    assert all(1 <= i <= MAX_INCARNATION for i in drawn) and len(drawn) > 40


def test_info_lists_the_segments_that_hold_rows_and_where_they_lie(monkeypatch) -> None:
    """What a client turns ids into storage positions with (TableInfo.id_segments): the row of
    sequence s of a listed segment lies at (first_position + s) % capacity; a segment whose
    rows were all overwritten is left out."""
    monkeypatch.setattr(IdSpace.__init__, "__defaults__", (4,))  # 4 rows per segment
    table = Table(TableConfig(name="t", capacity=6))
    issued = torch.cat([table.insert({"row": torch.arange(k, k + 3)}) for k in range(0, 9, 3)])
    segments = table.info().id_segments
    assert segments == ((1, 3), (2, 6))  # rows 3..8 stored: segment 0 (rows 0..2) is gone
    firsts = dict(segments)
    live = issued[3:].numpy()
    incarnations = (live >> 40) & 0xFFFF
    positions = [(firsts[int(i)] + int(q)) % 6 for i, q in zip(incarnations, live & (2**40 - 1))]
    read = table.read_rows(positions=np.asarray(positions))
    assert read.ids.tolist() == live.tolist()
