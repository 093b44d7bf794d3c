"""The wire: what the replay server and its clients exchange, defined once.

The generated protobuf modules (``replay_proto.v1``), the tensor codec, the
request and response bodies (``messages``, ``sample_codec``), dtype names,
flat keys, the batch container and the error kinds. Both ``replay_server``
and ``replay_client`` import this package; it imports neither of them, nor
the learner runtime (``replay_feed``).
"""

from replay_proto.batch import EXTRAS, SampleBatch
from replay_proto.dtypes import DTYPES, dtype_from_name, dtype_name
from replay_proto.error_kinds import ERROR_KIND_KEY, ErrorKind
from replay_proto.keys import KEY_SEPARATOR, flatten, unflatten

__all__ = [
    "DTYPES",
    "ERROR_KIND_KEY",
    "EXTRAS",
    "KEY_SEPARATOR",
    "ErrorKind",
    "SampleBatch",
    "dtype_from_name",
    "dtype_name",
    "flatten",
    "unflatten",
]
