"""The gRPC service: a thin adapter over the engine (decode, call, encode).

Import direction: ``replay_proto`` <- engine <- ``service`` <- ``cli``.
"""

from replay_server.service.server import ReplayServer

__all__ = ["ReplayServer"]
