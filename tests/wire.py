"""Wire messages built by hand, for tests that speak the protocol directly (a client sends an
insert through :func:`replay_proto.messages.insert_parts`, chunked where it is large)."""

from __future__ import annotations

import queue
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import grpc
import torch

from replay_feed.shared_ring import host_id
from replay_proto.codec import frame
from replay_proto.messages import insert_parts
from replay_proto.v1 import replay_pb2 as pb


def encode_insert(table: str, columns: Mapping[str, torch.Tensor],
                  priorities: torch.Tensor | None = None) -> bytes:
    """One ``InsertRequest`` message: header and payload joined."""
    return frame(*insert_parts(table, columns, priorities))


@contextmanager
def unanswered_ring_offer(address: str, table: str, batch_size: int
                          ) -> Iterator[pb.SharedMemoryOffer]:
    """A ``SampleStream`` from this host that asks for shared memory, takes the first batch
    with the server's ring offer (yielded) and never answers it while the block runs; the
    call ends with the block."""
    held: queue.SimpleQueue = queue.SimpleQueue()

    def requests() -> Iterator[bytes]:
        yield pb.SampleStreamRequest(
            request=pb.SampleRequest(table=table, batch_size=batch_size), credits=2,
            shared_memory=True, host_id=host_id()).SerializeToString()
        held.get(timeout=30)  # the learner never answers the offer

    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream("/replay.v1.ReplayService/SampleStream")(requests(),
                                                                              timeout=30)
        try:
            yield pb.SampleResponse.FromString(next(call)).shared_memory_offer
        finally:
            held.put(None)
