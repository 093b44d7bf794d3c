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

Costs (B = batch, n = capacity, D = log2(n / BLOCK)):
``find`` O(B * (D + BLOCK)) or O(n / BLOCK + B * D) for large B;
``set`` O(B * (log B + BLOCK + D)); ``total``/``min_positive`` O(1).

Not thread-safe: the owning sampler is called under its table's lock.
"""

from __future__ import annotations

import numpy as np
import torch

from replay_server.engine.snapshot import saved_copy

BLOCK = 16
"""Leaves per block (the fan-in of the bottom level)."""

_LARGE_BATCH = 8
"""``find`` switches to the prefix-sum path when ``batch * _LARGE_BATCH >= blocks``."""

_TOP_NODES = 4096
"""The tree is kept down to a level of this many nodes: sums and minima above it
are single reductions over that level, and a descent starts with one prefix
search there, which saves two numpy calls per level skipped."""

_LANE_LOOP_MIN = 2048
"""From this many blocks on, 16-wide reductions run lane by lane across the batch."""


def _sorted_unique(values: np.ndarray) -> np.ndarray:
    """``np.unique`` for an already sorted array, in O(n) instead of a sort."""
    keep = np.empty(values.size, dtype=bool)
    keep[:1] = True
    np.not_equal(values[1:], values[:-1], out=keep[1:])
    return values[keep]


def _search_prefix(
    values: np.ndarray, u: np.ndarray, prefix: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """For each ``u``, the index ``i`` whose prefix interval of ``values`` holds it, and
    ``u`` minus the sum before ``i``. Never returns an index past the last positive value.
    ``prefix`` is ``np.cumsum(values)`` if the caller has it."""
    if prefix is None:
        prefix = np.cumsum(values)
    index = np.searchsorted(prefix, u, side="right")
    np.minimum(index, int(np.flatnonzero(values > 0)[-1]), out=index)
    below = np.where(index > 0, prefix[index - 1], 0.0)
    return index, np.maximum(u - below, 0.0)


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
        self._top_prefix: np.ndarray | None = None  # cumsum of the top level, until a change
        self._sum = np.zeros(2 * self._p, dtype=np.float64)
        # Minima: one per block, plus the global one cached (stale only after the block
        # holding it was raised; then one scan over the blocks restores it).
        self._block_min = np.full(self._blocks, np.inf, dtype=np.float32)
        self._min_value = np.float32(np.inf)
        self._min_stale = False
        self._mark = np.zeros(self._blocks, dtype=bool)  # scratch for _touched_blocks

    def total(self) -> float:
        """Sum of all leaves."""
        return float(self._prefix()[-1])

    def _prefix(self) -> np.ndarray:
        if self._top_prefix is None:
            self._top_prefix = np.cumsum(self._sum[self._top : 2 * self._top])
        return self._top_prefix

    def min_positive(self) -> float:
        """Smallest leaf value > 0, or ``inf`` if there is none.

        O(1), except after an update raised the smallest leaf: then O(capacity / 16) once.
        """
        if self._min_stale:
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
        self._leaves[slots] = np.asarray(values, dtype=np.float32).reshape(-1)
        self._refresh(self._touched_blocks(slots))

    def _touched_blocks(self, slots: np.ndarray) -> np.ndarray:
        """Sorted unique blocks of ``slots``: a sort for few slots, a bitmap scan for many."""
        blocks = slots // BLOCK
        if blocks.size * 64 < self._blocks:
            return np.unique(blocks)
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
        self._min_value, self._min_stale = np.float32(np.inf), False

    def rebuild(self) -> None:
        """Recompute every inner node from the leaves."""
        self._refresh(np.arange(self._blocks))

    def _refresh(self, blocks: np.ndarray) -> None:
        """Recompute blocks ``blocks`` (sorted, unique) and all their ancestors."""
        p, sums = self._p, self._sum
        self._top_prefix = None
        leaves = self._leaf_blocks[blocks]
        positive = np.where(leaves > 0, leaves, np.float32(np.inf))
        if blocks.size < _LANE_LOOP_MIN:
            sums[p + blocks] = leaves.sum(1, dtype=np.float64)
            smallest = positive.min(1)
        else:  # lane by lane across blocks: reducing a length-16 axis is slow for many rows
            total = np.zeros(blocks.size)
            smallest = positive[:, 0].copy()
            for lane in range(BLOCK):
                total += leaves[:, lane]
                np.minimum(smallest, positive[:, lane], out=smallest)
            sums[p + blocks] = total
        self._update_min(blocks, smallest)
        nodes, size = p + blocks, p  # nodes of the level [size, 2 * size)
        while size > self._top:
            size //= 2
            if nodes.size * 4 >= size:  # few nodes here: recompute the whole level
                sums[size : 2 * size] = sums[2 * size : 4 * size].reshape(-1, 2).sum(1)
                nodes = np.arange(size, 2 * size)
            else:
                nodes = _sorted_unique(nodes // 2)
                sums[nodes] = sums[2 * nodes] + sums[2 * nodes + 1]

    def _update_min(self, blocks: np.ndarray, minima: np.ndarray) -> None:
        if not self._min_stale:
            lowest = minima.min()
            if lowest <= self._min_value:
                self._min_value = lowest  # nothing untouched is lower than the old minimum
            elif (self._block_min[blocks] == self._min_value).any():
                self._min_stale = True  # the block holding the minimum was raised
        self._block_min[blocks] = minima

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
        if u.size * _LARGE_BATCH >= self._blocks:
            blocks, u = self._find_blocks_by_prefix(u)
        else:
            blocks, u = self._find_blocks_by_descent(u)
        return self._find_in_blocks(blocks, u)

    def _find_blocks_by_descent(self, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        sums, top = self._sum, self._top
        node, u = _search_prefix(sums[top : 2 * top], u, self._prefix())
        node += top
        while node[0] < self._p:
            node *= 2
            left = sums[node]
            right = u >= left
            u -= np.where(right, left, 0.0)
            node += right
        blocks = node - self._p
        empty = sums[node] <= 0  # only where rounding walked off the end of the range
        if empty.any():
            blocks[empty], u[empty] = self._find_blocks_by_prefix(
                np.full(int(empty.sum()), np.nextafter(self.total(), 0.0))
            )
        return blocks, u

    def _find_blocks_by_prefix(self, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return _search_prefix(self._sum[self._p : self._p + self._blocks], u)

    def _find_in_blocks(self, blocks: np.ndarray, u: np.ndarray) -> np.ndarray:
        values = self._leaf_blocks[blocks]
        if u.size < _LANE_LOOP_MIN:
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
        return blocks * BLOCK + within

    def state_dict(self, used: int) -> dict[str, torch.Tensor]:
        """The first ``used`` leaves (inner nodes are rebuilt on load)."""
        return {"leaves": torch.from_numpy(saved_copy(self._leaves[:used]))}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        leaves = np.asarray(state["leaves"], dtype=np.float32)
        self._leaves.fill(0)
        self._leaves[: leaves.size] = leaves
        self.rebuild()
