"""replay_client: the client library of replay-server.

``ReplayClient`` builds a client for an address: one server's
(:class:`ServerClient`) or a sharded replay's (``replay_client.sharded``),
both implementing :class:`ReplayApi`; ``Writer`` appends an actor's steps in
the background (``VectorWriter``: a vector env's, one episode per sub-env); ``stream(...)`` feeds a learner (options:
:class:`StreamOptions`); ``RemoteReplayBuffer`` puts a table behind TorchRL's
replay-buffer API; errors are typed (``replay_client.errors``). This package
never imports ``replay_server``.
"""

from replay_client import errors
from replay_client.api import ReplayApi
from replay_client.client import ReplayClient
from replay_client.server_client import ServerClient
from replay_client.sharded.placement import by_episode  # where a sharded client puts episodes
from replay_client.table_info import ServerInfo, TableCapabilities, TableInfo
from replay_client.errors import ReplayError
from replay_client.tls import TlsConfig
from replay_client.variables import Variable
from replay_client.vector_writer import VectorWriter
from replay_client.writer import Writer
from replay_feed.options import StreamOptions
from replay_proto.batch import SampleBatch

__all__ = ["RemoteReplayBuffer", "ReplayApi", "ReplayClient", "ReplayError", "SampleBatch",
           "ServerClient", "ServerInfo", "StreamOptions", "TableCapabilities", "TableInfo",
           "TlsConfig", "Variable", "VectorWriter", "Writer", "by_episode", "errors"]


def __getattr__(name: str) -> object:
    # RemoteReplayBuffer imports tensordict: only when asked for.
    if name == "RemoteReplayBuffer":
        from replay_client.torchrl import RemoteReplayBuffer

        return RemoteReplayBuffer
    raise AttributeError(f"module 'replay_client' has no attribute {name!r}")
