"""What the replay server and its clients share: dtype names, flat keys, batch containers.

Both ``replay_server`` and ``replay_client`` import this package; it imports
neither of them.
"""

from replay_proto.batch import SampleBatch
from replay_proto.dtypes import DTYPES, dtype_from_name, dtype_name
from replay_proto.keys import KEY_SEPARATOR, flatten, unflatten

__all__ = [
    "DTYPES",
    "KEY_SEPARATOR",
    "SampleBatch",
    "dtype_from_name",
    "dtype_name",
    "flatten",
    "unflatten",
]
