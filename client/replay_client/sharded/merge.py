"""Exact sampling over many shards: split a batch by mass, merge the parts as one table's.

One logical table is spread over shards; shard ``s`` holds drawable units
(rows, or valid slice starts) of total mass ``M_s`` (see
:mod:`replay_proto.mass`). One table holding every unit would draw unit ``i``
with probability ``P(i) = mass_i / sum_s M_s``. The sharded client gets the
same distribution in one round of calls:

1. **Split.** The batch's ``B`` draws are split across shards multinomially,
   ``(k_s) ~ Multinomial(B, q)`` with ``q_s = M_s / sum M`` from the masses the
   shards last reported (:class:`MassBook`). Drawing ``k_s`` units from shard
   ``s`` (each with its local probability ``mass_i / M_s``) and shuffling the
   parts together gives ``B`` iid draws with ``P(i) = q_s * mass_i / M_s``:
   the one-table distribution whenever the masses are as reported.
2. **Merge.** Every shard answers with its rows and the mass it drew them
   with, so the merged batch reports, for each row, the probability it was
   actually drawn with, ``q_s * p_local``, and importance weights
   ``(N * P(i)) ** -beta / max_j (N * P(j)) ** -beta`` over all units of all
   shards: ``(min_P / P(i)) ** beta`` with ``min_P = min_s q_s * m_s / M_s``
   (``m_s``: shard ``s``'s smallest positive unit mass). With unchanged
   masses these are exactly one table's probabilities and weights.

Staleness: the split uses masses as of each shard's last answer to this
client (a sample, or an ``info`` refresh of a shard that got no draws). If
shard ``s``'s mass changed by a factor ``(1 + e_s)`` since (other clients'
inserts and updates, this client's own updates), shard ``s`` is drawn with
probability ``q_s`` instead of ``q_s (1 + e_s) / (1 + e)`` (``e``: the
mass-weighted mean change): off by a factor within ``[(1 - E)/(1 + E),
(1 + E)/(1 - E)]`` for ``|e_s| <= E``. Within a shard the draw is exact,
and the probabilities and weights reported are those of the draw actually
made, so importance weighting stays unbiased for it.

Cost: O(B) for the split and the merge's arithmetic, plus one copy of each
row, from the shard's answer (or its shared-memory slot) straight into the
merged batch (a learner's staging buffer): the same bytes a concatenation
would copy, and no more. Rows shuffled into place are copied as whole
blocks of memory (:func:`scatter_rows`): torch's ``index_copy_`` moves them
an element at a time, which made a merged batch of Atari rows (7 MB) cost
tens of milliseconds on one core and two shards stream 3-10x slower than
one (issue 28).

Hostile or broken shards: every mass a shard reports is checked before it is
stored or used (:func:`checked_mass`): a total that is not finite and >= 0, a
smallest unit mass that is not > 0, or a negative count is refused with
:class:`~replay_client.errors.ShardingError` naming the shard, so a NaN or
infinite mass can never poison a batch's probabilities and weights, nor make
a split that can never be drawn.

Thread-safety: :class:`MassBook` takes its own lock; the functions are pure.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from replay_client.errors import ShardingError
from replay_proto.batch import SampleBatch
from replay_proto.dtypes import numpy_view
from replay_proto.mass import SamplingMass, union_mass


def checked_mass(shard: int, mass: SamplingMass) -> SamplingMass:
    """``mass`` if it is one a table can have, else :class:`ShardingError` naming ``shard``.

    A table's mass has a finite total >= 0, a smallest positive unit mass > 0
    (``inf`` when it has no unit of positive mass) and a count >= 0.
    """
    total, low, count = mass.total, mass.min_positive, mass.count
    if not (math.isfinite(total) and total >= 0 and low > 0 and not math.isnan(low)
            and count >= 0):
        raise ShardingError(
            f"shard {shard} reported a sampling mass that no table can have (total={total!r}, "
            f"min_positive={low!r}, count={count!r}; a total must be finite and >= 0, the "
            f"smallest unit mass > 0): refused, nothing merged with it")
    return mass


def checked_masses(masses: Mapping[int, SamplingMass]) -> None:
    """:func:`checked_mass` on every shard's mass."""
    for shard, mass in masses.items():
        checked_mass(shard, mass)


class MassBook:
    """The sampling mass each shard last reported, per table (what the next split uses)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._masses: dict[str, dict[int, SamplingMass]] = {}

    def get(self, table: str) -> dict[int, SamplingMass]:
        with self._lock:
            return dict(self._masses.get(table, {}))

    def put(self, table: str, shard: int, mass: SamplingMass) -> None:
        """Note ``shard``'s mass (checked: :func:`checked_mass` raises for a bad one)."""
        checked_mass(shard, mass)
        with self._lock:
            self._masses.setdefault(table, {})[shard] = mass

    def forget(self, table: str | None = None, shard: int | None = None) -> None:
        """Drop what is known of ``table`` (all: ``None``), on ``shard`` only if given."""
        with self._lock:
            for name in [table] if table is not None else list(self._masses):
                known = self._masses.get(name, {})
                if shard is None:
                    known.clear()
                else:
                    known.pop(shard, None)


def split(batch_size: int, masses: Mapping[int, SamplingMass],
          generator: np.random.Generator) -> dict[int, int]:
    """Draws per shard: ``Multinomial(batch_size, M_s / sum M)`` (shards of mass 0 get none).

    Raises:
        ShardingError: a shard's mass is not one a table can have (a ``ValueError``
            too: catch it first).
        ValueError: no shard has any mass (nothing can be drawn anywhere).
    """
    checked_masses(masses)
    shards = [s for s in sorted(masses) if masses[s].total > 0]
    if not shards:
        raise ValueError("no shard has anything to sample")
    if len(shards) == 1:
        return {shards[0]: batch_size}
    totals = np.array([masses[s].total for s in shards], dtype=np.float64)
    counts = generator.multinomial(batch_size, totals / totals.sum())
    return {s: int(k) for s, k in zip(shards, counts)}


def shares(masses: Mapping[int, SamplingMass]) -> dict[int, float]:
    """``q_s = M_s / sum M``: the probability that one draw goes to shard ``s`` (see :func:`split`).

    Raises:
        ShardingError: a shard's mass is not one a table can have.
    """
    checked_masses(masses)
    total = math.fsum(m.total for m in masses.values())
    return {s: (m.total / total if total > 0 else 0.0) for s, m in masses.items()}


def min_probability(q: Mapping[int, float], fresh: Mapping[int, SamplingMass]) -> float:
    """``min_P = min_s q_s * m_s / M_s`` over the shards that can be drawn (``inf``: none)."""
    candidates = [q[s] * fresh[s].min_positive / fresh[s].total
                  for s in fresh if q.get(s, 0.0) > 0 and fresh[s].total > 0]
    return min(candidates) if candidates else math.inf


Pieces = Mapping[int, Sequence[SampleBatch]]
"""Each drawn shard's rows, as one or more pieces in the order drawn (views, or whole batches)."""


def merge(parts: Mapping[int, SampleBatch], q: Mapping[int, float],
          fresh: Mapping[int, SamplingMass], beta: float | None,
          generator: np.random.Generator, missing: tuple[int, ...] = ()) -> SampleBatch:
    """The parts as one new batch of ``sum k_s`` iid draws from the union (see :func:`merge_into`)."""
    pieces = {s: [b] for s, b in parts.items()}
    first = next(iter(parts.values()))
    total = sum(b.batch_size for b in parts.values())
    out = [torch.empty((total, *t.shape[1:]), dtype=t.dtype) for t in first.tensors()]
    return merge_into(out, list(first.columns), pieces, q, fresh, beta, generator, missing)


def _in_union(piece: SampleBatch, q_s: float, low: float, beta: float | None
              ) -> list[torch.Tensor]:
    """A piece's tensors as rows of the union: probabilities ``q_s * p_local`` and, where
    prioritized, weights ``(min_P / P(i)) ** beta`` (``low``: ``min_P``)."""
    prob = piece.probabilities.numpy().astype(np.float64) * q_s
    weight = (torch.from_numpy(np.power(low / prob, beta).astype(np.float32))
              if beta is not None else piece.weights)
    return [*piece.columns.values(), piece.ids, weight, torch.from_numpy(prob)]


def scatter_rows(dest: torch.Tensor, positions: torch.Tensor, src: torch.Tensor) -> None:
    """``dest[positions[i]] = src[i]`` for every row ``i`` of ``src``, each row copied once.

    On host memory each row moves as one block (numpy's fancy assignment: a
    ``memcpy`` per row of a contiguous tensor, the GIL released): a 28 KB
    Atari row costs what a contiguous copy of it does. torch's ``index_copy_``
    instead walks every element through its indexing kernel, 30-100x slower
    for such rows. Other devices, and dtypes that differ (``index_copy_``
    refuses them, naming both), go through ``index_copy_``.

    Args:
        dest: the batch being written (rows on dim 0).
        positions: int64 row indices into ``dest``, one per row of ``src``.
        src: the rows (same dtype and per-row shape as ``dest``).

    Raises:
        IndexError: a position past the end of ``dest``.
        RuntimeError: shapes or dtypes that do not match (torch's message).

    Thread-safety: writes ``dest`` only; callers own it.
    """
    host = dest.device.type == "cpu" and src.device.type == "cpu"
    if not host or dest.dtype != src.dtype or dest.shape[1:] != src.shape[1:] \
            or positions.shape != src.shape[:1]:
        dest.index_copy_(0, positions, src)
        return
    if src.numel() == 0:
        return
    numpy_view(dest)[numpy_view(positions)] = numpy_view(src)


def _scatter_host(dest: torch.Tensor, view: np.ndarray, positions: np.ndarray,
                  src: torch.Tensor) -> bool:
    """:func:`scatter_rows` into host tensor ``dest`` through its numpy ``view`` (made once
    per batch), when ``src`` is a host tensor of its dtype and row shape; ``False``
    (nothing written) otherwise."""
    if src.device.type != "cpu" or src.dtype != dest.dtype or src.shape[1:] != dest.shape[1:] \
            or src.shape[0] != positions.shape[0]:
        return False
    if src.numel():
        view[positions] = numpy_view(src)
    return True


def merge_into(out: Sequence[torch.Tensor], keys: Sequence[str], pieces: Pieces,
               q: Mapping[int, float], fresh: Mapping[int, SamplingMass], beta: float | None,
               generator: np.random.Generator, missing: tuple[int, ...] = (),
               copy: Callable[[torch.Tensor, int, torch.Tensor], None] | None = None
               ) -> SampleBatch:
    """Write the drawn pieces into ``out`` as one batch of iid draws from the union.

    Each row is copied once, from its piece straight into ``out`` (a
    learner's pinned staging buffers, say): to random positions when several
    shards contributed (the parts shuffled together), in order when one did.
    Its probability is ``q_s * p_local`` and, for a prioritized table
    (``beta``), its weight ``(min_P / P(i)) ** beta`` over every shard's units.

    Args:
        out: the batch's tensors (columns in ``keys`` order, then ids, weights,
            probabilities), ``sum k_s`` rows each.
        keys: the columns' flat keys.
        pieces: the drawn rows per shard (each piece's ``probabilities`` local).
        q: the shares the batch was split with, for every shard (:func:`shares`).
        fresh: every shard's mass as of this batch (for ``min_P`` and the batch's mass).
        beta: the table's importance exponent; ``None``: not prioritized (weights as drawn).
        generator: shuffles the parts together.
        missing: shards left out (degraded mode), noted on the batch.
        copy: ``copy(dest, start, src)`` for contiguous row copies (a feed's
            parallel copier); default: one ``copy_``.
    """
    checked_masses(fresh)
    n = len(keys)
    sizes = {s: sum(p.batch_size for p in ps) for s, ps in pieces.items() if ps}
    total = sum(sizes.values())
    low = min_probability(q, fresh) if beta is not None else math.inf
    shuffled = len(sizes) > 1
    order = generator.permutation(total) if shuffled else None
    # Host destinations' numpy views, made once per batch (a view per row copy cost more
    # than the copy of a small row).
    views = [numpy_view(dest) if dest.device.type == "cpu" else None
             for dest in out] if shuffled else []
    # One shard holding all the mass drew exactly as one table: its numbers stand as drawn.
    as_drawn = not shuffled and q.get(next(iter(sizes), -1), 0.0) == 1.0
    start = 0
    for shard in sorted(sizes):
        for piece in pieces[shard]:
            rows = piece.batch_size
            sources = piece.tensors() if as_drawn else _in_union(piece, q[shard], low, beta)
            if order is None:
                for dest, src in zip(out, sources):
                    if copy is not None and dest.device.type == "cpu":
                        copy(dest, start, src)
                    else:
                        dest[start:start + rows].copy_(src)
            else:
                positions = order[start:start + rows]
                for dest, view, src in zip(out, views, sources):
                    if view is None or not _scatter_host(dest, view, positions, src):
                        scatter_rows(dest, torch.from_numpy(positions), src)
            start += rows
    return SampleBatch.from_flat(
        dict(zip(keys, out[:n])), out[n:],
        union_mass(fresh.values()),
        missing_shards=missing,
    )


def split_more(batch_size: int, first: Mapping[int, int], masses: Mapping[int, SamplingMass],
               more: int, available: Mapping[int, int],
               generator: np.random.Generator) -> dict[int, np.ndarray]:
    """The draws per shard of a pass of merged batches: ``first``'s (already split), then up
    to ``more`` batches split as :func:`split` splits each (one multinomial call for all),
    as many as the rows ``available`` on every shard cover.

    Returns:
        ``{shard: counts}``, one count per batch of the pass (the first one's first), for
        the shards of ``first``.
    """
    shards = sorted(first)
    head = np.array([[first[s] for s in shards]], dtype=np.int64)
    totals = np.array([masses[s].total for s in shards], dtype=np.float64)
    drawn = generator.multinomial(batch_size, totals / totals.sum(), size=more)
    table = np.concatenate([head, drawn])
    covered = np.cumsum(table, axis=0) <= np.array([available[s] for s in shards])
    batches = int(np.logical_and.accumulate(covered.all(axis=1)).sum())
    return {s: table[:batches, i] for i, s in enumerate(shards)}


def merge_group(outs: Sequence[Sequence[torch.Tensor]], keys: Sequence[str], pieces: Pieces,
                counts: Mapping[int, np.ndarray], q: Mapping[int, float],
                fresh: Mapping[int, SamplingMass], beta: float | None,
                generator: np.random.Generator, missing: tuple[int, ...] = ()
                ) -> list[SampleBatch]:
    """Write a pass of merged batches at once: batch ``b`` takes the next ``counts[s][b]``
    rows of each shard's ``pieces`` (in order) and is written into ``outs[b]`` as
    :func:`merge_into` writes one (rows shuffled together, one table's probabilities and
    weights), from the same masses.

    For small rows, whose merge is all fixed costs (a 256-row batch of 17 floats is 25
    KB): the pieces are joined once per pass, the probabilities and weights worked out
    once, and each batch's every column is one gather. It copies each row twice (the join,
    the gather), so large rows, which pass one batch at a time, go to :func:`merge_into`.
    Pieces that are not host rows of the batch's dtypes and row shapes are merged batch by
    batch by :func:`merge_into` too (which refuses a dtype that differs, naming both).

    Args:
        outs: each batch's tensors, as :func:`merge_into`'s ``out``.
        keys: the columns' flat keys.
        pieces: each shard's rows for the whole pass, in order.
        counts: each shard's rows per batch (:func:`split_more`); every batch's total is
            the rows of its ``out``.
        q, fresh, beta, generator, missing: as :func:`merge_into`'s.
    """
    shards = [s for s in sorted(counts) if counts[s].sum() > 0]
    joined = _joined([p.tensors() for s in shards for p in pieces[s]], outs[0])
    if joined is None:
        cut = {s: _cut(pieces[s], counts[s]) for s in shards}
        return [merge_into(out, keys, {s: cut[s][b] for s in shards if cut[s][b]}, q, fresh,
                           beta, generator, missing) for b, out in enumerate(outs)]
    checked_masses(fresh)
    n = len(keys)
    sources = [numpy_view(t) for t in joined[:n + 1]]
    local = joined[n + 2].numpy().astype(np.float64, copy=False)
    prob = local * np.repeat([q[s] for s in shards], [int(counts[s].sum()) for s in shards])
    if beta is None:
        weights = numpy_view(joined[n + 1])
    else:
        weights = np.power(min_probability(q, fresh) / prob, beta).astype(np.float32)
    sources += [weights, prob]
    # Each row's batch (shard by shard, batch by batch), then each batch's rows in a
    # random order: its shards' parts shuffled together, as merge_into shuffles them.
    table = np.array([counts[s] for s in shards])
    label = np.repeat(np.tile(np.arange(len(outs)), len(shards)), table.ravel())
    rows = np.argsort(label, kind="stable").reshape(len(outs), -1)
    order = generator.permuted(rows, axis=1)
    mass = union_mass(fresh.values())
    batches = []
    for out, picks in zip(outs, order):
        for dest, src in zip(out, sources):
            src.take(picks, axis=0, out=numpy_view(dest), mode="wrap")
        batches.append(SampleBatch.from_flat(dict(zip(keys, out[:n])), out[n:], mass,
                                             missing_shards=missing))
    return batches


def _joined(tensors: Sequence[Sequence[torch.Tensor]], layout: Sequence[torch.Tensor]
            ) -> list[torch.Tensor] | None:
    """Each tensor of the pieces (``tensors``: each piece's, in :meth:`SampleBatch.tensors`
    order) joined along the rows, when every piece holds host rows of ``layout``'s dtypes
    and row shapes (``None`` otherwise: nothing is converted). The checks are the cheap
    ones per piece (host, the dtype itself); shapes are checked once joined."""
    joined = []
    for i, dest in enumerate(layout):
        column = [t[i] for t in tensors]
        dtype = dest.dtype
        if not dest.is_cpu or any(c.dtype is not dtype or not c.is_cpu for c in column):
            return None
        try:
            whole = torch.cat(column)
        except RuntimeError:  # row shapes that differ between pieces
            return None
        if whole.shape[1:] != dest.shape[1:]:
            return None
        joined.append(whole)
    return joined


def _cut(pieces: Sequence[SampleBatch], counts: np.ndarray) -> list[list[SampleBatch]]:
    """``pieces`` (rows in order) cut into consecutive runs of ``counts`` rows, as views."""
    out: list[list[SampleBatch]] = []
    queue = list(pieces)
    start = 0
    for count in counts.tolist():
        run: list[SampleBatch] = []
        while count:
            piece = queue[0]
            take = min(count, piece.batch_size - start)
            run.append(piece if take == piece.batch_size else piece.rows(start, start + take))
            start += take
            count -= take
            if start == piece.batch_size:
                queue.pop(0)
                start = 0
        out.append(run)
    return out
