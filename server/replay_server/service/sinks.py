"""The registry of batch sinks: the transports a server offers its learners, by name.

A stream starts on gRPC messages (:class:`~replay_server.service.batch_sink.MessageSink`);
when it opens, the kinds below are asked in order, and the first that makes a
sink for the learner's first message offers it with the first batch. A new
transport is a module with its :class:`~replay_server.service.batch_sink.SinkKind`
and one line here (a test registers its own in :data:`SINKS` the same way).
The names are those of ``replay_client.sources``, the learner's side.
"""

from __future__ import annotations

from replay_server.service.batch_sink import SinkKind
from replay_server.service.cuda_ipc_sink import CUDA_IPC
from replay_server.service.ring_sink import RING

SINKS: dict[str, SinkKind] = {
    CUDA_IPC.name: CUDA_IPC,
    RING.name: RING,
}
"""Every transport besides gRPC messages, best first."""
