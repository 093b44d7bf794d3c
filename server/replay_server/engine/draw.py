"""A sample's draw: which rows a batch takes, and the batch read from them.

A table's sample has two steps under its lock. :func:`draw` asks the
sampler for ``batch_size`` rows, or, where rows leave when sampled
(``fifo``/``lifo``, ``max_times_sampled``), the remover, which draws through
the sampler and retires what it hands out for the last time; a draw under a
lease is held by the table's leases (:mod:`replay_server.engine.leases`)
until acknowledged, given back or expired. :func:`batch_of` reads the drawn
rows through the table's top reader (slices, n-step returns, frame stacks
shape them there) into a :class:`~replay_proto.batch.SampleBatch` with its ids,
weights and probabilities.

The table (:meth:`~replay_server.engine.table.Table.sample`) is the entry
point: it checks the call, consults the rate limiter, counts the sample and
places the batch on its device; these two functions are not thread-safe on
their own (the table's lock serializes them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from replay_proto.batch import SampleBatch
from replay_proto.mass import SamplingMass
from replay_server.engine.leases import LeaseRequest
from replay_server.engine.samplers import Removal, SampleIndex
from replay_server.engine.table_parts import TableParts
from replay_server.errors import EmptyTableError

__all__ = ["batch_of", "draw"]


def draw(parts: TableParts, batch_size: int, lease: LeaseRequest | None, table: str
         ) -> tuple[SampleIndex, SamplingMass | None]:
    """Draw ``batch_size`` rows from the sampler, or through the remover where rows leave
    when sampled (counting those retired), taken under ``lease`` if given; the draw and
    the mass its probabilities are relative to. Under the table's lock.

    Raises:
        EmptyTableError: nothing can be drawn (naming ``table``). RateLimitedError: the
            remover's rows are all out on leases.
    """
    mass = parts.sampler.mass()
    removals: list[Removal] = []
    remover = parts.remover
    try:
        if remover is None:
            index = parts.sampler.sample(batch_size, parts.generator)
        else:
            index, removals = remover.sample(parts.sampler, batch_size, parts.generator,
                                             table, can_wait=parts.limiter.enabled)
    except EmptyTableError as exc:
        raise EmptyTableError(f"table {table!r}: {exc}") from None
    if remover is not None:
        retired = sum(removal.positions.size for removal in removals)
        parts.counters.retired += retired
        parts.limiter.deleted(retired if remover.removes_rows else 0)
    if lease is not None:
        parts.leases.hold(lease, index, removals, mass)
    return index, mass


def batch_of(parts: TableParts, index: Any, mass: Any,
             out: Mapping[str, torch.Tensor] | None) -> SampleBatch:
    """The batch of a drawn ``index``, not yet placed on the table's device (under the
    table's lock); ``out``: the caller's tensors to read the rows into."""
    assert parts.storage is not None
    columns = parts.top.read(index.ids, None, out, index.slots)
    ids = parts.ids.ids_of(index.ids, parts.ring.first_live)
    return SampleBatch.from_columns(columns, torch.from_numpy(ids),
                                    torch.from_numpy(index.weights),
                                    torch.from_numpy(index.probabilities), mass)
