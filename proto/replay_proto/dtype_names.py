"""The dtype names a table column may have, with each one's size: no torch needed.

The names are the stable ones schemas, checkpoints and the wire carry
(:mod:`replay_proto.dtypes` maps each to its ``torch.dtype``, built from this
table, and its tests check every size against torch's). What reads a config
without running a table (``replay-server check-config``: a schema's
``"float32[17]"``, the bytes a table promises at start) reads this module
alone, so it never pays for importing torch.
"""

from __future__ import annotations

ITEMSIZES: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
}
"""Every storable dtype's name -> bytes per element, in the order messages list them."""


def check_dtype_name(name: object) -> str:
    """``name`` itself, where it names a storable dtype.

    Raises:
        ValueError: no supported dtype has that name (the message lists them).
    """
    if not isinstance(name, str) or name not in ITEMSIZES:
        raise ValueError(f"unknown dtype name {name!r}; supported dtypes: "
                         f"{', '.join(ITEMSIZES)}")
    return name
