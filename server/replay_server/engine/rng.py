"""A table's random generator state as plain values (for state dicts and checkpoints)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from replay_server.errors import ConfigError


def generator_state(generator: np.random.Generator) -> dict[str, Any]:
    """PCG64 state as plain values (its 128-bit integers as decimal strings)."""
    state = generator.bit_generator.state
    return {
        "bit_generator": state["bit_generator"],
        "state": str(state["state"]["state"]),
        "inc": str(state["state"]["inc"]),
        "has_uint32": int(state["has_uint32"]),
        "uinteger": int(state["uinteger"]),
    }


def generator_from_state(saved: Mapping[str, Any]) -> dict[str, Any]:
    """The ``bit_generator.state`` to assign for a :func:`generator_state`.

    Raises:
        ConfigError: the saved generator is not PCG64.
    """
    if saved["bit_generator"] != "PCG64":
        raise ConfigError(f"saved random generator is {saved['bit_generator']!r}, expected PCG64")
    return {
        "bit_generator": "PCG64",
        "state": {"state": int(saved["state"]), "inc": int(saved["inc"])},
        "has_uint32": int(saved["has_uint32"]),
        "uinteger": int(saved["uinteger"]),
    }
