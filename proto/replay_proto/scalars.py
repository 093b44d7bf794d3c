"""What counts as an integer or a number in a caller's argument, on either side.

Python's ``bool`` is an ``int`` (``True == 1``), so ``isinstance(True, int)``
holds; an option that takes a count or a number of seconds must refuse
``True`` all the same, or a config typo becomes a count of 1. Every check of
that kind asks these two predicates. Python's types only, unless ``numpy``
also admits numpy's scalars (for values that come from arrays). Pure,
thread-safe; imports no torch.
"""

from __future__ import annotations

from typing import Any, TypeGuard

import numpy as np

_INTS: tuple[type, ...] = (int,)
_NUMPY_INTS: tuple[type, ...] = (int, np.integer)
_REALS: tuple[type, ...] = (int, float)
_NUMPY_REALS: tuple[type, ...] = (int, float, np.integer, np.floating)


def is_int(value: Any, *, numpy: bool = False) -> TypeGuard[int]:
    """Whether ``value`` is an integer and not a bool (with ``numpy``: numpy's integers too)."""
    return isinstance(value, _NUMPY_INTS if numpy else _INTS) and not isinstance(value, bool)


def is_real(value: Any, *, numpy: bool = False) -> bool:
    """Whether ``value`` is an int or a float and not a bool (with ``numpy``: numpy's too).
    Infinities and NaN are reals: bound them where they matter."""
    return isinstance(value, _NUMPY_REALS if numpy else _REALS) and not isinstance(value, bool)
