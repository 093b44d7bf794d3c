"""How a table draws, changed at run time: a prioritized table's ``alpha`` and ``beta``, and
the seed of its random generator.

TorchRL anneals ``beta`` towards 1 during training (``rb.sampler.beta = x``,
its ``ParameterScheduler``) and some schedules change ``alpha``; a TorchRL
buffer given a seeded ``generator`` draws reproducibly. A table's exponents
start at its config's and its generator at its ``seed``;
:func:`set_sampling` changes them from the next draw on. Stored priorities
keep their meaning: each row's sampling mass ``p ** alpha`` is re-expressed
with the new ``alpha`` (O(capacity), once), as TorchRL's
``PrioritizedSampler.alpha`` setter does. The exponents in force are part of
the sampler's state and the generator's state is the table's, so snapshots
and checkpoints keep both.

The table's :meth:`~replay_server.engine.table.Table.set_sampling` is the
entry point: it checks the settings (:func:`check`), then runs
:func:`set_sampling` under its lock.
"""

from __future__ import annotations

import math
import numpy as np

from replay_proto.scalars import is_int, is_real
from replay_server.engine.config import TableConfig
from replay_server.engine.inputs import max_priority
from replay_server.engine.table_parts import TableParts
from replay_server.errors import InvalidArgumentError, NoPrioritiesError


def check(config: TableConfig, alpha: float | None, beta: float | None,
          seed: int | None) -> None:
    """Refuse settings a table cannot take (before its lock).

    Raises:
        NoPrioritiesError: ``alpha`` or ``beta`` for a table without priorities.
        InvalidArgumentError: an exponent that is not a finite number >= 0, or a seed
            that is not an integer in [0, 2**128).
    """
    if (alpha is not None or beta is not None) and not config.sampler.is_prioritized:
        raise NoPrioritiesError(f"table {config.name!r} uses sampler {config.sampler.value!r}, "
                                f"which has no alpha or beta")
    for name, value in (("alpha", alpha), ("beta", beta)):
        if value is None:
            continue
        if not is_real(value) or not math.isfinite(value) or value < 0:
            raise InvalidArgumentError(
                f"table {config.name!r}: {name} must be a finite number >= 0, got {value!r}")
    if seed is not None and (not is_int(seed) or not 0 <= seed < 2**128):
        raise InvalidArgumentError(
            f"table {config.name!r}: seed must be an integer in [0, 2**128), got {seed!r}")


def set_sampling(parts: TableParts, config: TableConfig, alpha: float | None,
                 beta: float | None, seed: int | None) -> tuple[float, float]:
    """Take the settings given (``None``: unchanged); returns ``(alpha, beta)`` in force
    (``(0.0, 0.0)`` for a table without priorities).

    Raises:
        InvalidArgumentError: the new ``alpha`` would overflow the sampling mass of the
            largest priority the table has seen (float32 sums). Nothing changed.
    """
    top = parts.sampler.max_priority or 0.0
    if alpha and top > max_priority(alpha):
        raise InvalidArgumentError(
            f"table {config.name!r}: alpha={alpha} would overflow the sampling mass of the "
            f"largest priority seen ({top}); it must keep p ** alpha within float32")
    if seed is not None:
        parts.generator.bit_generator.state = np.random.PCG64(seed).state
    if not parts.sampler.traits.priorities:
        return 0.0, 0.0
    return parts.sampler.set_exponents(alpha, beta)
