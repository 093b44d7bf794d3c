"""The registry of batch sources: the transports a learner can read, by name.

A call asks every kind below (in order) whether to ask the server for its
transport; the one whose offer comes with the first batch reads the stream's
later batches. A new transport is a module with its
:class:`~replay_client.batch_source.SourceKind` and one line here (a test
registers its own in :data:`SOURCES` the same way). The names are those of
``replay_server.service.sinks``, the server's side.
"""

from __future__ import annotations

from replay_client.batch_source import SourceKind
from replay_client.cuda_ipc_source import CUDA_IPC
from replay_client.ring_source import RING

SOURCES: dict[str, SourceKind] = {
    CUDA_IPC.name: CUDA_IPC,
    RING.name: RING,
}
"""Every transport besides gRPC messages, best first."""
