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

Cost: O(B) for the split and the merge's arithmetic, plus one scatter copy
of each shard's rows into the merged batch (the same bytes a concatenation
would copy).

Thread-safety: :class:`MassBook` takes its own lock; the functions are pure.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping

import numpy as np
import torch

from replay_proto.batch import SampleBatch
from replay_proto.mass import SamplingMass


class MassBook:
    """The sampling mass each shard last reported, per table (what the next split uses)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._masses: dict[str, dict[int, SamplingMass]] = {}

    def get(self, table: str) -> dict[int, SamplingMass]:
        with self._lock:
            return dict(self._masses.get(table, {}))

    def put(self, table: str, shard: int, mass: SamplingMass) -> None:
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
        ValueError: no shard has any mass (nothing can be drawn anywhere).
    """
    shards = [s for s in sorted(masses) if masses[s].total > 0]
    if not shards:
        raise ValueError("no shard has anything to sample")
    if len(shards) == 1:
        return {shards[0]: batch_size}
    totals = np.array([masses[s].total for s in shards], dtype=np.float64)
    counts = generator.multinomial(batch_size, totals / totals.sum())
    return {s: int(k) for s, k in zip(shards, counts)}


def shares(masses: Mapping[int, SamplingMass]) -> dict[int, float]:
    """``q_s = M_s / sum M``: the probability that one draw goes to shard ``s`` (see :func:`split`)."""
    total = math.fsum(m.total for m in masses.values())
    return {s: (m.total / total if total > 0 else 0.0) for s, m in masses.items()}


def min_probability(q: Mapping[int, float], fresh: Mapping[int, SamplingMass]) -> float:
    """``min_P = min_s q_s * m_s / M_s`` over the shards that can be drawn (``inf``: none)."""
    candidates = [q[s] * fresh[s].min_positive / fresh[s].total
                  for s in fresh if q.get(s, 0.0) > 0 and fresh[s].total > 0]
    return min(candidates) if candidates else math.inf


def merge(parts: Mapping[int, SampleBatch], q: Mapping[int, float],
          fresh: Mapping[int, SamplingMass], beta: float | None,
          generator: np.random.Generator, missing: tuple[int, ...] = ()) -> SampleBatch:
    """The parts as one batch of ``sum k_s`` iid draws from the union (see the module docstring).

    Args:
        parts: each sampled shard's batch (its ``mass``: what its local
            probabilities are relative to).
        q: the shares the batch was split with, for every shard (:func:`shares`).
        fresh: every shard's mass as of this call (a sampled shard's is its
            batch's; the others' from a refresh).
        beta: the table's importance exponent; ``None``: not prioritized (weights stay ones).
        generator: shuffles the parts together.
        missing: shards left out (degraded mode), noted on the batch.
    """
    shards = sorted(parts)
    batches = [parts[s] for s in shards]
    probabilities = [b.probabilities.to(torch.float64) * q[s] for s, b in zip(shards, batches)]
    if beta is None:
        weights = [b.weights for b in batches]
    else:
        low = min_probability(q, fresh)
        weights = [torch.pow(low / prob, beta).to(torch.float32) for prob in probabilities]
    sizes = [b.batch_size for b in batches]
    total = sum(sizes)
    positions = torch.split(torch.from_numpy(generator.permutation(total)), sizes)
    columns = {key: _scatter([b.columns[key] for b in batches], positions, total)
               for key in batches[0].columns}
    return SampleBatch.from_columns(
        columns,
        _scatter([b.ids for b in batches], positions, total),
        _scatter(weights, positions, total),
        _scatter(probabilities, positions, total),
        SamplingMass(math.fsum(m.total for m in fresh.values()),
                     min((m.min_positive for m in fresh.values()), default=math.inf),
                     sum(m.count for m in fresh.values())),
        missing_shards=missing,
    )


def _scatter(pieces: list[torch.Tensor], positions: tuple[torch.Tensor, ...],
             total: int) -> torch.Tensor:
    """One tensor of ``total`` rows holding ``pieces[j]`` at rows ``positions[j]``."""
    out = torch.empty((total, *pieces[0].shape[1:]), dtype=pieces[0].dtype)
    for piece, rows in zip(pieces, positions):
        out.index_copy_(0, rows, piece)
    return out
