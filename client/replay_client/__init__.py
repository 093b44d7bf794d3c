"""replay_client: the client library of replay-server.

``ReplayClient`` talks to a server over gRPC; ``Writer`` appends an actor's
steps in the background; errors are typed (``replay_client.errors``). This
package never imports ``replay_server``.
"""

from replay_client import errors
from replay_client.client import ReplayClient, TableInfo
from replay_client.errors import ReplayError
from replay_client.tls import TlsConfig
from replay_client.writer import Writer
from replay_proto.batch import SampleBatch

__all__ = ["ReplayClient", "ReplayError", "SampleBatch", "TableInfo", "TlsConfig", "Writer",
           "errors"]
