"""A sum tree (with a min tree beside it) over per-slot priorities, batched in numpy.

This is the index behind proportional prioritized replay: leaf ``i`` holds the
sampling mass of slot ``i`` (``p_i ** alpha``, or 0 for a slot that must not be
drawn). Drawing ``u ~ U[0, total)`` and finding the leaf whose prefix-sum
interval contains ``u`` draws slot ``i`` with probability ``leaf_i / total``.

Layout. Leaves are float32 (4 bytes per slot), grouped in blocks of
:data:`BLOCK`. Above the blocks sits a binary heap-ordered tree of float64 sums
(node ``P + b`` is block ``b``), kept down to a top level of at most
:data:`_TOP_NODES` nodes, whose single reduction gives the total. Minima of
positive leaves are kept per block, with the global minimum cached. In all
1 to 2 bytes per slot (1.7 at 10M slots). Sums are always recomputed from
their children, never adjusted by deltas, so no rounding error accumulates.

Batched operations, no Python loop over the batch:

* ``find`` descends the binary tree for all targets at once (one vectorized
  step per level), then scans each target's block. For batches that are large
  next to the number of blocks it instead takes one prefix sum over the block
  sums and binary-searches all targets in it, which is cheaper there.
* ``set`` writes the leaves, refreshes their blocks, then walks up level by
  level; a level with few nodes compared to the batch is recomputed whole.
* Small batches (the call a learner makes every step) pay numpy's fixed cost
  per call more than per element, so their path makes the fewest calls: a
  block's running sums and sums are small matrix products (see
  :data:`_SMALL_BATCH`), and the block minima are refreshed lazily, only when
  the cached global minimum goes stale.

Costs (B = batch, n = capacity, D = log2(n / BLOCK)):
``find`` O(B * (D + BLOCK)) or O(n / BLOCK + B * D) for large B;
``set`` O(B * (log B + BLOCK + D)); ``total``/``min_positive`` O(1).

Not thread-safe: the owning sampler is called under its table's lock (a large
``find`` may split its own read-only work across :mod:`~replay_server.engine.workers`).
"""

from __future__ import annotations

import numpy as np
import torch

from replay_server.engine import workers
from replay_server.engine.slot_memory import SUMTREE_SLOT_BYTES
from replay_server.engine.snapshot import saved_copy

BLOCK = 16
"""Leaves per block (the fan-in of the bottom level)."""

SLOT_BYTES = SUMTREE_SLOT_BYTES
"""Bytes per slot a sum tree is promised (declared in :mod:`replay_server.engine.slot_memory`)."""

_LARGE_BATCH = 8
"""``find`` switches to the prefix-sum path when ``batch * _LARGE_BATCH >= blocks``."""

_TOP_NODES = 4096
"""The tree is kept down to a level of this many nodes: sums and minima above it
are single reductions over that level, and a descent starts with one prefix
search there, which saves two numpy calls per level skipped."""

_LANE_LOOP_MIN = 2048
"""From this many blocks on, 16-wide reductions run lane by lane across the batch."""

_PARALLEL_FIND_MIN = 8192
"""With cores to spare (:data:`~replay_server.engine.workers.MANY_CORES`), ``find``
splits its targets across threads in parts of at least this many (every part
only reads the tree)."""

_SMALL_BATCH = 512
"""Up to this many rows, 16-wide sums and running sums are small matrix products.

numpy's reductions along a short last axis cost about 80 ns per row; a product
with a constant 16 x 16 matrix costs a few microseconds for the whole batch.
OpenBLAS runs products this small on the calling thread (its threading
thresholds are m*n*k >= 262,144 for gemm and m*n >= 9,216 for gemv), so no
BLAS thread pool wakes up. The sums are of float32 leaves or float64 nodes in
float64, with one fixed order of terms per row, so running sums never decrease
along a row (a zero child adds an exact zero)."""

_RUNNING = np.triu(np.ones((BLOCK, BLOCK)))
"""``rows @ _RUNNING`` = ``cumsum(rows, axis=1)``."""

_ONES = np.ones(BLOCK)

_BYTE_SUM = np.uint64(0x0101010101010101)
_BYTE_SHIFT = np.uint64(56)


def _sorted_unique(values: np.ndarray) -> np.ndarray:
    """``np.unique`` for an already sorted array, in O(n) instead of a sort."""
    keep = np.empty(values.size, dtype=bool)
    keep[:1] = True
    np.not_equal(values[1:], values[:-1], out=keep[1:])
    return values[keep]


class _Prefix:
    """Running sums of one level of nodes, for a binary search of many targets at once.

    ``sums[i]`` is the mass before node ``i`` (``sums[0] = 0``, ``sums[-1]`` the
    total); ``last`` is the last node with mass, which a search never passes.
    """

    __slots__ = ("sums", "last")

    def __init__(self, values: np.ndarray) -> None:
        self.sums = np.concatenate(([0.0], np.cumsum(values)))
        # The first node whose running sum reaches the total: no target below the total
        # lies past it, even where a later positive node is too small to move the sum.
        self.last = max(0, int(np.searchsorted(self.sums, self.sums[-1], side="left")) - 1)

    @property
    def total(self) -> float:
        return float(self.sums[-1])

    def search(self, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each ``u``, the node whose interval holds it, and ``u`` minus the mass before it."""
        index = np.searchsorted(self.sums, u, side="right")
        index -= 1  # sums[index] <= u (u >= 0 and sums[0] = 0), so the offset is >= 0
        np.clip(index, 0, self.last, out=index)
        return index, u - self.sums[index]


def _count_true(mask: np.ndarray) -> np.ndarray:
    """Per row of a C-contiguous ``[B, 16]`` bool array, how many are True (int64).

    The 16 bytes of a row are two uint64 words of 0/1 bytes: add the words, then
    sum their bytes with one multiply (byte k of ``x * 0x0101..01`` is the sum
    of bytes 0..k). Three array operations instead of numpy's per-row reduction.
    """
    words = mask.view(np.uint64)
    counts = words[:, 0] + words[:, 1]
    counts *= _BYTE_SUM
    counts >>= _BYTE_SHIFT
    return counts.astype(np.int64)


def _blocks_below(rows: np.ndarray, u: np.ndarray) -> np.ndarray:
    """For each row of ``[B, 16]`` masses and its ``u``, how many leading entries sum to <= ``u``.

    That is the index of the entry whose running-sum interval holds ``u`` (16 where
    rounding put ``u`` at or past the row's sum). For at most :data:`_SMALL_BATCH`
    rows: one matrix product gives the running sums.
    """
    running = rows.astype(np.float64) @ _RUNNING
    return _count_true(running <= u[:, None])


def _positive_minima(rows: np.ndarray) -> np.ndarray:
    """Per row of ``[n, 16]`` leaves, the smallest positive one (``inf`` where none)."""
    positive = np.where(rows > 0, rows, np.float32(np.inf))
    if rows.shape[0] < _LANE_LOOP_MIN:
        return positive.min(1)
    smallest = positive[:, 0].copy()
    for lane in range(1, BLOCK):
        np.minimum(smallest, positive[:, lane], out=smallest)
    return smallest


class SumTree:
    """Batched sum/min tree over ``capacity`` leaves (all zero initially).

    Args:
        capacity: number of leaves (slots).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._blocks = -(-capacity // BLOCK)
        self._p = 1 << max(0, (self._blocks - 1).bit_length())  # first block node
        self._leaves = np.zeros(self._blocks * BLOCK, dtype=np.float32)
        self._leaf_blocks = self._leaves.reshape(self._blocks, BLOCK)
        self._top = min(self._p, _TOP_NODES)  # nodes of the top level: [top, 2 * top)
        self._top_prefix: _Prefix | None = None  # the top level's running sums, until a change
        self._sum = np.zeros(2 * self._p, dtype=np.float64)
        # Minima: the global one cached, and one per block, refreshed lazily: a set marks
        # its blocks' minima out of date, and only when the cached minimum goes stale (the
        # leaf holding it was raised or zeroed) are those blocks rescanned, then all minima.
        self._block_min = np.full(self._blocks, np.inf, dtype=np.float32)
        self._block_min_old = np.zeros(self._blocks, dtype=bool)
        self._min_value = np.float32(np.inf)
        self._min_stale = False
        self._mark = np.zeros(self._blocks, dtype=bool)  # scratch for _touched_blocks

    def total(self) -> float:
        """Sum of all leaves."""
        return self._prefix().total

    def _prefix(self) -> _Prefix:
        if self._top_prefix is None:
            self._top_prefix = _Prefix(self._sum[self._top : 2 * self._top])
        return self._top_prefix

    def min_positive(self) -> float:
        """Smallest leaf value > 0, or ``inf`` if there is none.

        O(1), except after a set raised or zeroed the smallest leaf: then once
        O(blocks set since the last rescan * 16 + capacity / 16).
        """
        if self._min_stale:
            old = np.flatnonzero(self._block_min_old)
            if old.size:
                self._block_min[old] = _positive_minima(self._leaf_blocks[old])
                self._block_min_old[old] = False
            self._min_value = self._block_min.min()
            self._min_stale = False
        return float(self._min_value)

    def get(self, slots: np.ndarray) -> np.ndarray:
        """Leaf values at ``slots``, as float64."""
        return self._leaves[np.asarray(slots)].astype(np.float64)

    def set(self, slots: np.ndarray, values: np.ndarray) -> None:
        """Set leaves ``slots`` to ``values`` (>= 0); for a repeated slot the last value wins.

        (NumPy assigns repeated indices of a 1-D fancy assignment in order;
        ``tests/server/test_sumtree.py`` pins that.)
        """
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        if slots.size == 0:
            return
        replaced = self._leaves[slots]
        self._leaves[slots] = np.asarray(values, dtype=np.float32).reshape(-1)
        blocks = self._touched_blocks(slots)
        self._refresh(blocks)
        self._note_minimum(replaced, self._leaves[slots], blocks)

    def _touched_blocks(self, slots: np.ndarray) -> np.ndarray:
        """Sorted unique blocks of ``slots``: a sort for few slots, a bitmap scan for many."""
        blocks = slots // BLOCK
        if blocks.size * 64 < self._blocks:
            blocks.sort()
            return _sorted_unique(blocks)
        self._mark[blocks] = True
        touched = np.flatnonzero(self._mark)
        self._mark[touched] = False
        return touched

    def clear(self) -> None:
        """Set every leaf to zero."""
        self._leaves.fill(0)
        self._sum.fill(0)
        self._top_prefix = None
        self._block_min.fill(np.inf)
        self._block_min_old.fill(False)
        self._min_value, self._min_stale = np.float32(np.inf), False

    def rebuild(self) -> None:
        """Recompute every inner node from the leaves."""
        blocks = np.arange(self._blocks)
        self._refresh(blocks)
        self._block_min_old.fill(True)
        self._min_stale = True

    def _refresh(self, blocks: np.ndarray) -> None:
        """Recompute the sums of blocks ``blocks`` (sorted, unique) and all their ancestors."""
        p, sums = self._p, self._sum
        self._top_prefix = None
        leaves = self._leaf_blocks[blocks]
        if blocks.size <= _SMALL_BATCH:
            sums[p + blocks] = leaves.astype(np.float64) @ _ONES
        elif blocks.size < _LANE_LOOP_MIN:
            sums[p + blocks] = leaves.sum(1, dtype=np.float64)
        else:  # lane by lane across blocks: reducing a length-16 axis is slow for many rows
            total = np.zeros(blocks.size)
            for lane in range(BLOCK):
                total += leaves[:, lane]
            sums[p + blocks] = total
        # Up the levels. Parents are not deduplicated: a repeated node is computed twice
        # from the same children (same value), which costs less than finding repeats.
        nodes, size = p + blocks, p  # nodes of the level [size, 2 * size)
        pairs = sums.reshape(-1, 2)  # row n: the children of node n
        whole = False
        while size > self._top:
            size //= 2
            if whole or blocks.size * 4 >= size:  # few nodes here: recompute the whole level
                sums[size : 2 * size] = pairs[size : 2 * size].sum(1)
                whole = True
            else:
                nodes >>= 1
                children = pairs[nodes]
                sums[nodes] = children[:, 0] + children[:, 1]

    def _note_minimum(self, replaced: np.ndarray, now: np.ndarray, blocks: np.ndarray) -> None:
        """Keep the cached minimum right after leaves ``replaced`` became ``now``."""
        self._block_min_old[blocks] = True
        if self._min_stale:
            return
        lowest = np.min(now, where=now > 0, initial=np.inf)
        if lowest <= self._min_value:
            self._min_value = lowest  # nothing untouched is lower than the old minimum
        elif (replaced == self._min_value).any():
            self._min_stale = True  # the leaf holding the minimum was raised or zeroed

    def find(self, targets: np.ndarray) -> np.ndarray:
        """For each target ``u`` in ``[0, total)``, the slot whose prefix interval holds it.

        That is the smallest ``i`` with ``sum(leaves[: i + 1]) > u``; the result
        always has a positive leaf, even where rounding puts ``u`` at the very
        end of the range.

        Args:
            targets: ``[B]`` floats.

        Returns:
            int64 ``[B]`` slots.
        """
        u = np.array(targets, dtype=np.float64)
        by_prefix = (_Prefix(self._sum[self._p : self._p + self._blocks])
                     if u.size * _LARGE_BATCH >= self._blocks else None)
        parts = min(workers.THREADS, u.size // _PARALLEL_FIND_MIN) if workers.MANY_CORES else 1
        if parts < 2:
            return self._find(u, by_prefix)
        self._prefix()  # the shared caches exist before the threads read them
        slots = np.empty(u.size, dtype=np.int64)
        bounds = np.linspace(0, u.size, parts + 1).astype(int)

        def part(span: tuple[int, int]) -> None:
            slots[span[0] : span[1]] = self._find(u[span[0] : span[1]], by_prefix)

        workers.run_split(part, list(zip(bounds[:-1], bounds[1:])), parts)
        return slots

    def _find(self, u: np.ndarray, by_prefix: _Prefix | None) -> np.ndarray:
        if by_prefix is not None:
            blocks, u = by_prefix.search(u)
        else:
            blocks, u = self._find_blocks_by_descent(u)
        return self._find_in_blocks(blocks, u)

    def _find_blocks_by_descent(self, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        sums, p = self._sum, self._p
        node, u = self._prefix().search(u)
        node += self._top
        while node[0] < p:
            node *= 2
            left = sums[node]
            right = u >= left
            np.subtract(u, left, out=u, where=right)
            node += right
        node -= p
        return node, u  # a block without mass (rounding at the range's end): see _find_in_blocks

    def _find_in_blocks(self, blocks: np.ndarray, u: np.ndarray) -> np.ndarray:
        values = self._leaf_blocks[blocks]
        if u.size <= _SMALL_BATCH:
            within = _blocks_below(values, u)
        elif u.size < _LANE_LOOP_MIN:
            within = (np.cumsum(values, axis=1, dtype=np.float64) <= u[:, None]).sum(1)
        else:  # a running sum lane by lane across the batch: cumsum along 16 is slow for many
            running = np.zeros(u.size)
            within = np.zeros(u.size, dtype=np.int64)
            for lane in range(BLOCK):
                running += values[:, lane]
                within += running <= u
        over = within >= BLOCK
        if over.any():  # rounding put u at the block's end: take its last positive leaf
            positive = values[over] > 0
            within[over] = BLOCK - 1 - np.argmax(positive[:, ::-1], axis=1)
            empty = np.flatnonzero(over)[~positive.any(1)]
            if empty.size:  # the descent walked off the end of the range into an empty block
                block = _Prefix(self._sum[self._p : self._p + self._blocks]).last
                blocks = blocks.copy()
                blocks[empty] = block
                within[empty] = BLOCK - 1 - np.argmax(self._leaf_blocks[block, ::-1] > 0)
        return blocks * BLOCK + within

    def state_dict(self, used: int) -> dict[str, torch.Tensor]:
        """The first ``used`` leaves (inner nodes are rebuilt on load)."""
        return {"leaves": torch.from_numpy(saved_copy(self._leaves[:used]))}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        leaves = np.asarray(state["leaves"], dtype=np.float32)
        self._leaves.fill(0)
        self._leaves[: leaves.size] = leaves
        self.rebuild()
