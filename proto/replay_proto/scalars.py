"""What counts as an integer or a number in a caller's argument, on either side.

Python's ``bool`` is an ``int`` (``True == 1``), so ``isinstance(True, int)``
holds; an option that takes a count or a number of seconds must refuse
``True`` all the same, or a config typo becomes a count of 1. Every check of
that kind asks these two predicates. Python's types only, unless ``numpy``
also admits numpy's scalars (for values that come from arrays). Pure,
thread-safe; imports neither torch nor numpy (a value can only be a numpy
scalar once numpy is loaded, so its types are looked up in ``sys.modules``).
"""

from __future__ import annotations

import sys
from typing import Any, TypeGuard

_INTS: tuple[type, ...] = (int,)
_REALS: tuple[type, ...] = (int, float)


def _with_numpy(types: tuple[type, ...], *kinds: str) -> tuple[type, ...]:
    """``types`` and numpy's scalar ``kinds`` (``"integer"``, ``"floating"``), if numpy is
    loaded: were it not, no value could be one of them."""
    np = sys.modules.get("numpy")
    return types if np is None else (*types, *(getattr(np, kind) for kind in kinds))


def is_int(value: Any, *, numpy: bool = False) -> TypeGuard[int]:
    """Whether ``value`` is an integer and not a bool (with ``numpy``: numpy's integers too)."""
    ints = _with_numpy(_INTS, "integer") if numpy else _INTS
    return isinstance(value, ints) and not isinstance(value, bool)


def is_real(value: Any, *, numpy: bool = False) -> bool:
    """Whether ``value`` is an int or a float and not a bool (with ``numpy``: numpy's too).
    Infinities and NaN are reals: bound them where they matter."""
    reals = _with_numpy(_REALS, "integer", "floating") if numpy else _REALS
    return isinstance(value, reals) and not isinstance(value, bool)
