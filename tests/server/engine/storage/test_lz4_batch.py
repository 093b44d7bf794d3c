"""The batch decoder: many lz4 blocks in one call give exactly python-lz4's rows, the columns
that use it gather what the block-by-block path gathers, and a batch that does not decode to
the bytes expected raises instead of handing out a wrong row."""

from __future__ import annotations

import lz4.block
import numpy as np
import pytest
import torch

from replay_server.engine.schema import FieldSpec
from replay_server.engine.storage import compressed, lz4_batch
from replay_server.engine.storage.compressed import Lz4Column, bound
from replay_server.engine.storage.lz4_batch import DECODER, Lz4Error, prefixed, zero_block
from tests.server.engine.storage.counting_decoder import CountingDecoder


def frames(n: int, row_bytes: int, seed: int) -> np.ndarray:
    """Rows that compress well (runs) and rows that do not (noise), mixed."""
    rng = np.random.default_rng(seed)
    rows = np.repeat(rng.integers(0, 255, (n, row_bytes // 64 + 1), dtype=np.uint8), 64,
                     axis=1)[:, :row_bytes].copy()
    rows[::3] = rng.integers(0, 255, (len(rows[::3]), row_bytes), dtype=np.uint8)
    return rows


def test_the_lz4_package_offers_the_frame_api_so_batches_decode_in_one_call() -> None:
    assert DECODER is not None


@pytest.mark.parametrize("row_bytes", [1, 7056, 100_000, 2_000_000])
def test_a_batch_decodes_to_python_lz4s_rows_bit_for_bit(row_bytes: int) -> None:
    """Every block size class of the frame format (64 KB to 4 MB), and never-written rows."""
    assert DECODER is not None
    rows = frames(6, row_bytes, seed=row_bytes)
    blocks = [prefixed(lz4.block.compress(row, store_size=False)) for row in rows]
    blocks.insert(2, zero_block(row_bytes))
    out = np.full((len(blocks), row_bytes), 7, dtype=np.uint8)
    DECODER.decode(DECODER.header(bound(row_bytes)), blocks, out)
    expected = [np.frombuffer(lz4.block.decompress(bytes(b[4:]), uncompressed_size=row_bytes),
                              dtype=np.uint8) for b in blocks[:2]]
    assert np.array_equal(out[:2], np.stack(expected))
    assert np.array_equal(out[:2], rows[:2])
    assert not out[2].any()
    assert np.array_equal(out[3:], rows[2:])


def test_a_batch_that_decodes_to_other_bytes_than_expected_raises_and_the_decoder_goes_on(
        ) -> None:
    assert DECODER is not None
    rows = frames(4, 7056, seed=1)
    blocks = [prefixed(lz4.block.compress(row, store_size=False)) for row in rows]
    header = DECODER.header(bound(7056))
    with pytest.raises(Lz4Error, match="4 lz4 blocks"):
        DECODER.decode(header, blocks, np.empty((3, 7056), dtype=np.uint8))  # too small
    with pytest.raises(Lz4Error):
        DECODER.decode(header, blocks, np.empty((5, 7056), dtype=np.uint8))  # too large
    broken = bytearray(blocks[1])
    broken[4:] = b"\xff" * (len(broken) - 4)  # a block that is not lz4
    with pytest.raises(Lz4Error):
        DECODER.decode(header, [blocks[0], bytes(broken)], np.empty((2, 7056), dtype=np.uint8))
    out = np.empty((4, 7056), dtype=np.uint8)
    DECODER.decode(header, blocks, out)  # the contexts that failed were reset, reused
    assert np.array_equal(out, rows)


def column_with(rows: np.ndarray, decoder) -> Lz4Column:
    """An lz4 column holding ``rows`` (its last slot never written), decoding with ``decoder``."""
    spec = FieldSpec(torch.uint8, (rows.shape[1],))
    original = compressed.DECODER
    compressed.DECODER = decoder
    try:
        column = Lz4Column(spec, len(rows) + 1)
    finally:
        compressed.DECODER = original
    encoded = column.encode(torch.from_numpy(rows))
    column.reserve(0, encoded)
    column.write(0, encoded)
    return column


@pytest.mark.parametrize("contiguous", [True, False])
def test_columns_gather_the_same_rows_with_and_without_the_batch_decoder(contiguous: bool
                                                                           ) -> None:
    """Large gathers (split across the worker pool), rows apart in the batch (a buffer copied
    over), repeated and never-written slots."""
    rows = frames(300, 7056, seed=2)
    fast, slow = column_with(rows, DECODER), column_with(rows, None)
    assert fast._decoder is not None and slow._decoder is None
    slots = np.random.default_rng(3).integers(0, 301, 700)
    results = []
    for column in (fast, slow):
        into = torch.full((700, 2, 7056), 9, dtype=torch.uint8)
        column.take(slots, into[:, 0] if not contiguous else into.view(1400, 7056)[:700])
        results.append(into)
    assert torch.equal(results[0], results[1])
    expected = np.concatenate([rows, np.zeros((1, 7056), dtype=np.uint8)])[slots]
    got = results[0][:, 0] if not contiguous else results[0].view(1400, 7056)[:700]
    assert np.array_equal(got.numpy(), expected)
    assert np.array_equal(fast[0:301], slow[0:301])


def test_a_region_take_equals_one_take_per_part_and_declines_other_columns() -> None:
    """Stacks of three frames of one column and the newest of another: one pass of lz4 columns
    of one spec; a column of another spec or without the decoder is left to the caller."""
    a, b = frames(50, 7056, seed=4), frames(50, 7056, seed=5)
    first, second = column_with(a, DECODER), column_with(b, DECODER)
    rng = np.random.default_rng(6)
    parts = [(first, rng.integers(0, 51, 40)) for _ in range(3)] + [(second,
                                                                     rng.integers(0, 51, 40))]
    into = torch.empty((40, 4, 7056), dtype=torch.uint8)
    assert first.take_regions([(parts, into)])
    for j, (column, slots) in enumerate(parts):
        alone = torch.empty((40, 7056), dtype=torch.uint8)
        column.take(slots, alone)
        assert torch.equal(into[:, j], alone)
    slow = column_with(b, None)
    assert not first.take_regions([([*parts[:3], (slow, parts[3][1])], into)])
    other = column_with(frames(50, 100, seed=7), DECODER)
    assert not first.take_regions([([parts[0], (other, parts[3][1])], into)])


def test_regions_that_repeat_rows_decode_each_distinct_row_once_and_copy_it() -> None:
    """Two destinations (an observation's stacks and the next one's) whose rows repeat within
    and across them: every place holds its row, and each distinct (column, slot) reached
    the decoder once."""
    a, b = frames(60, 7056, seed=8), frames(60, 7056, seed=9)
    counting = CountingDecoder(7056)
    first, second = column_with(a, counting), column_with(b, counting)
    rng = np.random.default_rng(10)
    n = 200  # 200 x 7 places from 61 slots per column: most rows repeat
    stacks = [(first, rng.integers(0, 60, n)) for _ in range(4)]
    following = [(first, stacks[j + 1][1]) for j in range(3)] + [(second, rng.integers(0, 61, n))]
    obs = torch.empty((n, 4, 7056), dtype=torch.uint8)
    nxt = torch.empty((n, 4, 7056), dtype=torch.uint8)
    assert first.take_regions([(stacks, obs), (following, nxt)])
    decoded = counting.blocks[:]
    for into, parts in ((obs, stacks), (nxt, following)):
        for j, (column, slots) in enumerate(parts):
            alone = torch.empty((n, 7056), dtype=torch.uint8)
            column.take(slots, alone)
            assert torch.equal(into[:, j], alone)
    distinct = {(id(column), int(slot)) for parts in (stacks, following)
                for column, slots in parts for slot in slots}
    assert len(decoded) == len(distinct)  # slot 60 of ``second`` (never written) too
    assert len(set(decoded)) == len(decoded)


def test_where_no_library_offers_the_frame_api_there_is_no_decoder(monkeypatch) -> None:
    monkeypatch.setattr(lz4_batch, "_library", lambda: None)
    assert lz4_batch.load() is None


@pytest.mark.parametrize("contiguous", [True, False])
def test_small_rows_joined_by_one_gather_decode_to_the_rows_of_the_block_by_block_path(
        contiguous: bool) -> None:
    """Compressed small rows (blocks of tens of bytes) are joined by the arena's numpy gather:
    the same rows as python-lz4 gives one by one, a batch large enough to split across the
    worker pool included; a batch with a never-written slot takes the slice-per-block path."""
    rows = frames(3000, 68, seed=8)
    fast, slow = column_with(rows, DECODER), column_with(rows, None)
    rng = np.random.default_rng(9)
    for count in (5, 40_000):
        slots = rng.integers(0, 3000, count)
        assert fast.arena.joined(slots, compressed._JOINED_BLOCK) is not None
        results = []
        for column in (fast, slow):
            into = torch.full((count, 2, 68), 9, dtype=torch.uint8)
            column.take(slots, into[:, 1] if not contiguous else into.view(2 * count, 68)[:count])
            results.append(into)
        assert torch.equal(results[0], results[1])
        got = results[0][:, 1] if not contiguous else results[0].view(2 * count, 68)[:count]
        assert np.array_equal(got.numpy(), rows[slots])
    unwritten = np.array([0, 3000, 1])
    assert fast.arena.joined(unwritten, compressed._JOINED_BLOCK) is None
    into = torch.full((3, 68), 9, dtype=torch.uint8)
    fast.take(unwritten, into)
    assert np.array_equal(into.numpy(), np.stack([rows[0], np.zeros(68, np.uint8), rows[1]]))


def test_the_arena_joins_blocks_only_when_all_are_written_and_small_enough() -> None:
    rows = frames(20, 7056, seed=10)
    column = column_with(rows, DECODER)
    arena, slots = column.arena, np.array([3, 1, 3, 7])
    widest = int(arena.lengths[slots].max())
    body, ends = arena.joined(slots, widest)
    assert body.tobytes() == b"".join(bytes(arena.block(int(s))) for s in slots)
    assert ends.tolist() == np.cumsum(arena.lengths[slots]).tolist()
    assert arena.joined(slots, widest - 1) is None  # a block wider than asked
    assert arena.joined(np.array([3, 20]), 1 << 20) is None  # slot 20 never written
