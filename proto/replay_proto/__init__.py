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

# ruff: noqa: F401 - the imports under TYPE_CHECKING are this package's exports

from typing import TYPE_CHECKING

from replay_proto.exports import lazy_exports

if TYPE_CHECKING:
    from replay_proto.batch import EXTRAS, SampleBatch
    from replay_proto.dtypes import DTYPES, dtype_from_name, dtype_name
    from replay_proto.error_kinds import ERROR_KIND_KEY, ErrorKind
    from replay_proto.keys import KEY_SEPARATOR, flatten, unflatten
else:
    __getattr__, __dir__ = lazy_exports(__name__)
