"""Same-host samples through a call stream's region: a batch gathered straight into /dev/shm.

A unary ``Sample`` of 256 Atari rows moves 7.2 MB through gRPC: about
6 ms of Python gRPC's own on the 2-core machine before any replay work
(``benchmarks/grpc_floor.py``), more than Reverb's whole call. A client on
the server's host instead sends the SampleRequest on its sample call stream
(``sample_in_region``): the batch is gathered from table storage straight
into the stream's region (:mod:`~replay_server.service.call_region`, one
slot), the extras (ids, weights, probabilities) after it, and the answer
says only where each tensor lies (a SampleResponse as a SampleStream's ring
batch). The client copies the batch out before it sends its next request,
so the slot is free again by then.

The size is checked before anything is drawn: a batch that would not fit
the region (or a stream with no region mapped) is answered with the region
size it needs and nothing changes (the client asks for a larger region, or
makes the Sample call). A table with no rows yet has no layout to check
against; its batch (drawn once data arrived) is gathered as the unary call
gathers it and copied in, and if it does not fit after all, answered with the
size needed: a queue table's lease gives the client's next request the same
rows.

Thread-safety: :func:`sample_in_region` runs in an engine thread, one request of
a stream at a time (the stream reads its next request only after answering).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from replay_feed.shared_ring import ALIGN, SharedRing, align
from replay_proto.sample_codec import encode_ring_batch
from replay_proto.v1 import replay_pb2 as pb
from replay_server.engine import LeaseRequest, Table
from replay_server.service.waiting import draw

Layout = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]
"""Flat key -> (dtype, shape) of each column of a batch (``Table.batch_layout``)."""

EXTRA_ROOM = 3 * ALIGN
"""Room the extras' alignment may take beyond ``Table.batch_nbytes``."""


def region_short(table: Table, batch_size: int, layout: Layout,
                 region: SharedRing | None) -> int:
    """0 if a batch of ``batch_size`` from ``table`` fits ``region`` (or the table has no
    layout yet to tell), else the region size it needs: its bytes (extras included), each
    tensor aligned."""
    needed = table.batch_nbytes(batch_size) + ALIGN * len(layout) + EXTRA_ROOM
    if region is None or (layout and region.slot_bytes < needed):
        return needed
    return 0


def sample_in_region(table: Table, request: pb.SampleRequest, lease: LeaseRequest | None,
                     region: SharedRing, layout: Layout) -> pb.SampledInRegion:
    """Draw the batch ``request`` asks for into ``region``'s slot (see the module
    docstring); :func:`region_short` said it fits.

    Args:
        table: the request's table.
        request: the parsed SampleRequest.
        lease: its lease (acknowledgements applied already), or ``None``.
        region: the stream's mapped region.
        layout: ``table.batch_layout(request.batch_size)`` ({} before the table's first
            rows), as the size was checked against.

    Raises:
        As the unary Sample's draw (``replay_server.service.waiting.draw``).
    """
    offsets: list[int] = []
    end = 0
    columns: dict[str, torch.Tensor] = {}
    for key, (dtype, shape) in layout.items():
        columns[key] = region.view(0, end, dtype, shape)
        offsets.append(end)
        end = align(end + columns[key].nbytes)
    batch = draw(table, request.batch_size, wait_for_data=request.wait_for_data,
                 out=columns or None, never_wait=request.never_wait, lease=lease)
    if not layout:  # the table had no rows when asked: its batch is copied in
        end = 0
        for key, column in batch.columns.items():
            if end + column.nbytes > region.slot_bytes:
                return pb.SampledInRegion(
                    region_bytes=sum(align(t.nbytes) for t in batch.tensors()))
            columns[key] = region.view(0, end, column.dtype, tuple(column.shape))
            columns[key].copy_(column)
            offsets.append(end)
            end = align(end + column.nbytes)
    extras = []
    for extra in batch.extras:
        if end + extra.nbytes > region.slot_bytes:  # only where the layout said otherwise
            return pb.SampledInRegion(region_bytes=end + sum(align(t.nbytes)
                                                            for t in batch.extras))
        view = region.view(0, end, extra.dtype, tuple(extra.shape))
        view.copy_(extra)
        extras.append(view)
        offsets.append(end)
        end = align(end + extra.nbytes)
    return pb.SampledInRegion(batch=encode_ring_batch(columns, extras, 0, 0, offsets,
                                                      batch.mass))
