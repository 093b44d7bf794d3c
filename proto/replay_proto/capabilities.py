"""What a table does: the ``TableCapabilities`` message of ``replay.proto``, as a frozen value.

The message is the one declaration of the capabilities (each field's meaning
is commented there). :class:`TableCapabilities` takes its fields, their order
and their types from the message's descriptor, so a field added to the
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

from dataclasses import asdict, field, make_dataclass
from typing import Any

from replay_proto.v1 import replay_pb2 as pb

__all__ = ["TableCapabilities"]

_DEFAULTS: dict[str, Any] = {"mergeable": True, "n_step": 1}
"""Defaults unlike the message's zero values (see the module)."""


def _from_proto(cls: type, message: pb.TableCapabilities) -> Any:
    """The capabilities a ``TableCapabilities`` message carries."""
    return cls(**{f.name: getattr(message, f.name) for f in pb.TableCapabilities.DESCRIPTOR.fields})


def _to_proto(self: Any) -> pb.TableCapabilities:
    """These capabilities as the ``TableCapabilities`` message."""
    return pb.TableCapabilities(**asdict(self))


def _fields() -> list[tuple[str, type, Any]]:
    blank = pb.TableCapabilities()
    fields = []
    for descriptor in pb.TableCapabilities.DESCRIPTOR.fields:
        default = _DEFAULTS.get(descriptor.name, getattr(blank, descriptor.name))
        fields.append((descriptor.name, type(default), field(default=default)))
    return fields


TableCapabilities: Any = make_dataclass(
    "TableCapabilities", _fields(), frozen=True, slots=True,
    namespace={"from_proto": classmethod(_from_proto), "to_proto": _to_proto,
               "__doc__": "What a table does: the fields of ``TableCapabilities`` in "
                          "``replay.proto`` (see :mod:`replay_proto.capabilities`)."})
TableCapabilities.__module__ = __name__
