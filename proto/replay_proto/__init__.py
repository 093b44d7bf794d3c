"""The wire: what the replay server and its clients exchange, defined once.

The generated protobuf modules (``replay_proto.v1``), the tensor codec, the
request and response bodies (``messages``, ``sample_codec``), dtype names,
flat keys, the batch container and the error kinds. Both ``replay_server``
and ``replay_client`` import this package; it imports neither of them, nor
the learner runtime (``replay_feed``). The names below are loaded on first
use: a program that needs only ``addresses`` or the generated code (the
server's operator commands) never loads torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from replay_proto.exports import lazy_exports

if TYPE_CHECKING:
    from replay_proto.batch import EXTRAS, SampleBatch
    from replay_proto.dtypes import DTYPES, dtype_from_name, dtype_name
    from replay_proto.error_kinds import ERROR_KIND_KEY, ErrorKind
    from replay_proto.keys import KEY_SEPARATOR, flatten, unflatten

_HOMES = {
    "EXTRAS": "replay_proto.batch",
    "SampleBatch": "replay_proto.batch",
    "DTYPES": "replay_proto.dtypes",
    "dtype_from_name": "replay_proto.dtypes",
    "dtype_name": "replay_proto.dtypes",
    "ERROR_KIND_KEY": "replay_proto.error_kinds",
    "ErrorKind": "replay_proto.error_kinds",
    "KEY_SEPARATOR": "replay_proto.keys",
    "flatten": "replay_proto.keys",
    "unflatten": "replay_proto.keys",
}

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


__getattr__ = lazy_exports(__name__, _HOMES)
