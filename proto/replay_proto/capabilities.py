"""What a table does: the ``TableCapabilities`` message of ``replay.proto``, as a frozen value.

The message is the one declaration of the capabilities (each field's meaning
is commented there). :class:`TableCapabilities` takes its fields, their order
and their types from the message (through ``replay_proto.v1.capability_fields``,
which ``proto/generate.py`` writes beside the protobuf code, so that declaring
capabilities, as reading a config does, loads no protobuf), so a field added to the
message appears here, on the server (whose parts fill it: the sampler class
declares its share, the table the rest) and on the client (which decides on
it, never on a sampler's name) with no other edit. Only two defaults differ
from the message's zero values, where zero would say something else: a table
is ``mergeable`` unless its sampler says otherwise, and ``n_step`` is 1 for
plain rows.

Immutable, hashable, and comparable by value; ``dataclasses.replace`` gives
a changed copy. Thread-safe.
"""

from __future__ import annotations

from dataclasses import field, make_dataclass
from typing import TYPE_CHECKING, Any

from replay_proto.v1.capability_fields import FIELDS

if TYPE_CHECKING:
    from replay_proto.v1 import replay_pb2 as pb

__all__ = ["TableCapabilities"]

_DEFAULTS: dict[str, Any] = {"mergeable": True, "n_step": 1}
"""Defaults unlike the message's zero values (see the module)."""


def _from_proto(cls: type, message: pb.TableCapabilities) -> Any:
    """The capabilities a ``TableCapabilities`` message carries."""
    return cls(**{name: getattr(message, name) for name, _ in FIELDS})


def _to_proto(self: Any) -> pb.TableCapabilities:
    """These capabilities as the ``TableCapabilities`` message."""
    from replay_proto.v1 import replay_pb2 as pb  # here: declaring capabilities needs none

    return pb.TableCapabilities(**{name: getattr(self, name) for name, _ in FIELDS})


def _fields() -> list[tuple[str, type, Any]]:
    fields = []
    for name, zero in FIELDS:
        default = _DEFAULTS.get(name, zero)
        fields.append((name, type(default), field(default=default)))
    return fields


TableCapabilities: Any = make_dataclass(
    "TableCapabilities", _fields(), frozen=True, slots=True,
    namespace={"from_proto": classmethod(_from_proto), "to_proto": _to_proto,
               "__doc__": "What a table does: the fields of ``TableCapabilities`` in "
                          "``replay.proto`` (see :mod:`replay_proto.capabilities`)."})
TableCapabilities.__module__ = __name__
