"""Table snapshots: the rows and state of one instant, read out while inserts go on.

The reference is ``state_dict()`` taken at the same instant with nothing
running concurrently (its slot layout is pinned by test_table.py); a
snapshot must equal it however inserts interleave with the reading.
"""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch

from replay_server import Table, TableConfig
from replay_server.engine.snapshot import Arena, saved_copy
from tests.server.engine.test_table_errors import assert_same_state

ROW_BYTES = 4 * 3 + 8  # obs float32[3] + row int64


def _table(kind: str = "uniform", capacity: int = 37) -> Table:
    extra = {"slice_len": 3} if "slice" in kind else {}
    return Table(TableConfig(name="t", capacity=capacity, sampler=kind, seed=0, **extra))


def _rows(start: int, n: int) -> dict[str, torch.Tensor]:
    row = torch.arange(start, start + n)
    return {"obs": row.to(torch.float32).unsqueeze(1).repeat(1, 3), "row": row,
            "episode": row // 7, "done": row % 7 == 6}


def _fill(table: Table, rows: int, step: int = 5) -> int:
    n = 0
    while n < rows:
        k = min(step, rows - n)
        table.insert(_rows(n, k))
        n += k
    return n


def _read(table: Table, snapshot, actions: list[int], next_row: int) -> tuple[dict, int]:
    """Read all pieces, inserting ``actions[i]`` rows before piece i; columns in slot order."""
    used = snapshot.rows.used
    out: dict[str, torch.Tensor] = {}
    iterator = snapshot.rows.pieces()
    expected_row = 0
    for step in range(10_000):  # bounded: a piece per step
        if step < len(actions) and actions[step]:
            table.insert(_rows(next_row, actions[step]))
            next_row += actions[step]
        piece = next(iterator, None)
        if piece is None:
            break
        assert piece.row == expected_row  # pieces come out in ring order, no gaps
        assert piece.slot == (snapshot.rows.first_slot + piece.row) % snapshot.rows.capacity
        expected_row += piece.count
        for key, rows in piece.columns.items():  # valid until the next piece is asked for
            column = out.setdefault(key, torch.empty((used, *rows.shape[1:]),
                                                     dtype=torch.from_numpy(rows).dtype))
            column[piece.slot : piece.slot + piece.count] = torch.from_numpy(rows)
    assert expected_row == used
    return out, next_row


@pytest.mark.parametrize("kind", ["uniform", "prioritized", "slice", "prioritized_slice"])
@pytest.mark.parametrize("stored", [0, 1, 20, 37, 100])
def test_snapshot_holds_the_instant_however_inserts_interleave(kind: str, stored: int) -> None:
    for seed in range(6):
        rng = random.Random(seed)
        table = _table(kind)
        next_row = _fill(table, stored, step=rng.randint(1, 9)) if stored else 0
        if stored == 0:
            table.insert(_rows(0, 1))
            table.reset()  # a schema, no live row, no slot written since the reset
            next_row = 1
        reference = table.state_dict()
        chunk = ROW_BYTES * rng.randint(1, 8)
        with table.snapshot(chunk_bytes=chunk) as snapshot:
            assert_same_state({**snapshot.state, "columns": reference["columns"]}, reference)
            actions = [rng.choice([0, 0, 1, 3, 8, 30, 37]) for _ in range(40)]
            columns, next_row = _read(table, snapshot, actions, next_row)
        if not columns:  # nothing written since the reset: no piece to read, nothing saved
            assert all(c.shape[0] == 0 for c in reference["columns"].values())
            continue
        assert list(columns) == list(reference["columns"])
        for key, column in reference["columns"].items():
            assert torch.equal(columns[key], column), (seed, key)


def test_pieces_start_at_the_oldest_row_of_a_full_ring() -> None:
    table = _table(capacity=10)
    _fill(table, 23, step=1)  # next insert overwrites slot 3, holding row 13
    with table.snapshot(chunk_bytes=ROW_BYTES * 4) as snapshot:
        assert snapshot.rows.first_slot == 3
        rows = [int(r) for p in snapshot.rows.pieces() for r in p.columns["row"]]
    assert rows == list(range(13, 23))


def test_pieces_never_wrap_past_the_last_slot() -> None:
    table = _table(capacity=10)
    _fill(table, 23, step=1)
    with table.snapshot(chunk_bytes=ROW_BYTES * 100) as snapshot:
        pieces = [(p.slot, p.count) for p in snapshot.rows.pieces()]
    assert pieces == [(3, 7), (0, 3)]


def test_a_closed_snapshot_no_longer_copies_rows_aside() -> None:
    table = _table(capacity=10)
    _fill(table, 10)
    snapshot = table.snapshot(chunk_bytes=ROW_BYTES)
    table.insert(_rows(10, 5))  # overwrites 5 rows not read yet: copied aside
    assert len(snapshot.rows._aside) >= 1
    snapshot.close()
    assert snapshot.rows._aside == type(snapshot.rows._aside)()
    assert table._parts.storage._snapshots == []
    table.insert(_rows(15, 5))
    assert snapshot.rows._aside == type(snapshot.rows._aside)()


def test_a_table_never_inserted_into_has_no_rows_to_snapshot() -> None:
    with _table().snapshot() as snapshot:
        assert snapshot.rows is None
        assert snapshot.state["schema"] is None and snapshot.state["columns"] == {}


def test_snapshot_under_concurrent_inserts_and_samples_equals_its_instant() -> None:
    table = _table("prioritized", capacity=500)
    _fill(table, 700, step=25)
    stop = threading.Event()
    errors: list[BaseException] = []

    def insert() -> None:
        n = 10_000
        try:
            for _ in range(2000):
                if stop.is_set():
                    return
                table.insert(_rows(n, 13))
                n += 13
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def sample() -> None:
        try:
            for _ in range(2000):
                if stop.is_set():
                    return
                table.sample(8)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    reference = table.state_dict()
    with table.snapshot(chunk_bytes=ROW_BYTES * 16) as snapshot:
        threads = [threading.Thread(target=insert), threading.Thread(target=sample)]
        for thread in threads:
            thread.start()
        columns = snapshot.rows.columns()
        stop.set()
        for thread in threads:
            thread.join(60)
    assert not errors, errors
    # The inserts began after the reference was taken, so the snapshot equals it.
    for key, column in reference["columns"].items():
        assert torch.equal(columns[key], column), key


def test_state_dict_is_unchanged_by_inserts_made_while_it_copies() -> None:
    table = _table(capacity=64)
    _fill(table, 64)
    expected = {k: v.clone() for k, v in table.state_dict()["columns"].items()}
    with table.snapshot(chunk_bytes=ROW_BYTES) as snapshot:
        it = snapshot.rows.pieces()
        rows = [torch.from_numpy(next(it).columns["row"].copy())]
        table.insert(_rows(1000, 64))  # overwrite the whole ring
        rows += [torch.from_numpy(p.columns["row"].copy()) for p in it]
    rows = torch.cat(rows)
    assert sorted(rows.tolist()) == sorted(expected["row"].tolist())


def test_saved_copy_draws_from_the_active_arena_and_falls_back_when_full() -> None:
    arena = Arena(1000)
    source = np.arange(10, dtype=np.int32)
    with arena.active():
        same = saved_copy(source)
        wider = saved_copy(source, np.int64)
        too_big = saved_copy(np.zeros(1000))
    outside = saved_copy(source)
    assert np.shares_memory(same, arena._buffer) and np.shares_memory(wider, arena._buffer)
    assert not np.shares_memory(too_big, arena._buffer)
    assert not np.shares_memory(outside, arena._buffer) and not np.shares_memory(outside, source)
    assert same.tolist() == wider.tolist() == source.tolist() and wider.dtype == np.int64
    assert arena.wanted == 64 + 128 + 8000  # aligned sizes, the next arena's size


@pytest.mark.parametrize("kind", ["prioritized", "slice", "prioritized_slice"])
def test_later_snapshots_copy_the_instant_into_an_arena_sized_by_the_last(kind: str) -> None:
    table = _table(kind, capacity=200)
    _fill(table, 150)
    assert table._instant_bytes == 0
    first = table.state_dict()  # into an arena of the bound: 16 bytes per slot
    assert 150 * 4 <= table._instant_bytes <= 150 * 16 + 1024  # what the copies took
    second = table.state_dict()  # into an arena of that size
    assert_same_state(second, first)
