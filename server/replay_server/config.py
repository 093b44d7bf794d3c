"""Table configuration: frozen, validated at construction.

A bad value raises :class:`~replay_server.errors.ConfigError` whose message
names the table, the field and the value; nothing is silently corrected.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from replay_server.errors import ConfigError
from replay_server.schema import FieldSpec

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_\-]{0,127}")

MAX_CAPACITY = 2**40
"""Rows per table, at most (ids are int64 insertion numbers, slots fit int64)."""


class SamplerKind(str, Enum):
    """How a table picks the rows of a sample (see ``replay_server.samplers``)."""

    UNIFORM = "uniform"
    PRIORITIZED = "prioritized"
    SLICE = "slice"
    PRIORITIZED_SLICE = "prioritized_slice"

    @property
    def is_prioritized(self) -> bool:
        return self in (SamplerKind.PRIORITIZED, SamplerKind.PRIORITIZED_SLICE)

    @property
    def is_slice(self) -> bool:
        return self in (SamplerKind.SLICE, SamplerKind.PRIORITIZED_SLICE)


@dataclass(frozen=True, kw_only=True)
class TableConfig:
    """Everything that defines one table.

    Attributes:
        name: the table's name (letters, digits, ``_`` and ``-``).
        capacity: rows kept; when full, the oldest row is overwritten (FIFO).
        sampler: ``uniform``, ``prioritized``, ``slice`` or ``prioritized_slice``.
        alpha: priority exponent, P(i) = p_i^alpha / sum_k p_k^alpha (prioritized kinds).
        beta: importance-weight exponent (prioritized kinds).
        slice_len: steps per sampled slice (slice kinds; required there, refused elsewhere).
        episode_key: int64 column holding each row's episode id (slice kinds need it).
        done_key: bool column whose True ends an episode (optional column).
        truncated_key: bool column whose True also ends an episode (optional column).
        schema: columns declared up front (flat key -> FieldSpec); ``None``: the
            first insert fixes it.
        pin_memory: allocate storage in page-locked memory (needs an accelerator).
        seed: seed of the table's random generator; ``None``: nondeterministic.
    """

    name: str
    capacity: int
    sampler: SamplerKind = SamplerKind.UNIFORM
    alpha: float = 0.6
    beta: float = 0.4
    slice_len: int | None = None
    episode_key: str = "episode"
    done_key: str = "done"
    truncated_key: str = "truncated"
    schema: dict[str, FieldSpec] | None = field(default=None, hash=False)
    pin_memory: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ConfigError(
                f"table name {self.name!r} is invalid: use 1-128 letters, digits, '_' or '-'"
            )
        where = f"table {self.name!r}"
        if not _is_int(self.capacity) or not 1 <= self.capacity <= MAX_CAPACITY:
            raise ConfigError(
                f"{where}: capacity must be an integer in [1, {MAX_CAPACITY}], got {self.capacity!r}"
            )
        try:
            object.__setattr__(self, "sampler", SamplerKind(self.sampler))
        except ValueError:
            kinds = ", ".join(k.value for k in SamplerKind)
            raise ConfigError(
                f"{where}: sampler must be one of {kinds}, got {self.sampler!r}"
            ) from None
        for name in ("alpha", "beta"):
            value = getattr(self, name)
            if not _is_real(value) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"{where}: {name} must be a finite number >= 0, got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.sampler.is_slice:
            if self.slice_len is None:
                raise ConfigError(f"{where}: sampler {self.sampler.value!r} needs slice_len")
            if not _is_int(self.slice_len) or not 1 <= self.slice_len <= self.capacity:
                raise ConfigError(
                    f"{where}: slice_len must be an integer in [1, capacity={self.capacity}], "
                    f"got {self.slice_len!r}"
                )
        elif self.slice_len is not None:
            raise ConfigError(
                f"{where}: slice_len={self.slice_len!r} is only used by the slice samplers, and "
                f"sampler is {self.sampler.value!r}; remove slice_len or choose sampler 'slice'"
            )
        for name in ("episode_key", "done_key", "truncated_key"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{where}: {name} must be a non-empty string, got {value!r}")
        keys = (self.episode_key, self.done_key, self.truncated_key)
        if len(set(keys)) != len(keys):
            raise ConfigError(
                f"{where}: episode_key, done_key and truncated_key must be different columns, "
                f"got {keys!r}"
            )
        if self.seed is not None and not _is_int(self.seed):
            raise ConfigError(f"{where}: seed must be an integer or omitted, got {self.seed!r}")
        if not isinstance(self.pin_memory, bool):
            raise ConfigError(f"{where}: pin_memory must be true or false, got {self.pin_memory!r}")
        if self.schema is not None:
            if not isinstance(self.schema, dict) or not self.schema:
                raise ConfigError(f"{where}: schema must be a non-empty mapping of key -> FieldSpec")
            for key, spec in self.schema.items():
                if not isinstance(spec, FieldSpec):
                    raise ConfigError(
                        f"{where}: schema[{key!r}] must be a FieldSpec, got {type(spec).__name__}"
                    )

    @property
    def episode_end_keys(self) -> tuple[str, str]:
        """Columns whose True ends an episode, in the order they are checked."""
        return (self.done_key, self.truncated_key)

    def describe(self) -> dict[str, Any]:
        """The config as plain values (for logs, ``info`` and checkpoints)."""
        return {
            "name": self.name,
            "capacity": self.capacity,
            "sampler": self.sampler.value,
            "alpha": self.alpha,
            "beta": self.beta,
            "slice_len": self.slice_len,
            "episode_key": self.episode_key,
            "done_key": self.done_key,
            "truncated_key": self.truncated_key,
        }


def default_table_configs(capacity: int = 100_000) -> list[TableConfig]:
    """The tables a server starts with when it is given no config: one per sampler kind.

    ``replay`` is prioritized (as in the design's examples); ``uniform``,
    ``slice`` and ``prioritized_slice`` are named after their sampler; slices
    are 32 steps long.
    """
    return [
        TableConfig(name="replay", capacity=capacity, sampler=SamplerKind.PRIORITIZED),
        TableConfig(name="uniform", capacity=capacity, sampler=SamplerKind.UNIFORM),
        TableConfig(name="slice", capacity=capacity, sampler=SamplerKind.SLICE, slice_len=32),
        TableConfig(
            name="prioritized_slice",
            capacity=capacity,
            sampler=SamplerKind.PRIORITIZED_SLICE,
            slice_len=32,
        ),
    ]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
