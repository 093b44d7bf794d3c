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

from replay_proto.keys import check_prefixes
from replay_server.errors import ConfigError
from replay_server.engine.samplers import SAMPLERS, SamplerTraits
from replay_server.engine.schema import FieldSpec

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_\-]{0,127}")
_DEVICE = re.compile(r"cpu|cuda(:(0|[1-9][0-9]{0,3}))?")

MAX_CAPACITY = 2**40
"""Rows per table, at most (ids are int64 insertion numbers, slots fit int64)."""

MAX_TIMES_SAMPLED = 2**32 - 1
"""Largest ``max_times_sampled`` (per-row counts are uint32)."""

DEFAULT_ERROR_ROWS = 1000
"""``error_buffer`` defaults to ``max(1, samples_per_insert) * max(min_size_to_sample, this)``."""


class StorageKind(str, Enum):
    """Where a table keeps its rows (see ``replay_server.engine.storage``)."""

    MEMORY = "memory"
    MEMMAP = "memmap"


class _SamplerKinds(str, Enum):
    """What a sampler's name tells, read from the declaration of the class it names."""

    @property
    def traits(self) -> SamplerTraits:
        return SAMPLERS[self.value].traits

    @property
    def is_queue(self) -> bool:
        """Consume-once kinds: a sample takes the oldest (fifo) or newest (lifo) rows away."""
        return self.traits.consumes

    @property
    def is_prioritized(self) -> bool:
        return self.traits.priorities

    @property
    def is_slice(self) -> bool:
        return self.traits.slices


SamplerKind = _SamplerKinds(  # type: ignore[call-overload]
    "SamplerKind", [(name.upper(), name) for name in SAMPLERS], module=__name__)
"""How a table picks the rows of a sample: one member per registered sampler
(:data:`~replay_server.engine.samplers.SAMPLERS`), named as the config names it."""


DEFAULT_LEASE_TIMEOUT_S = 60.0
"""How long a queue's rows taken under a lease wait for their acknowledgement by default."""

MAX_LEASE_TIMEOUT_S = 86_400.0
"""The longest ``lease_timeout_s`` (a day)."""


@dataclass(frozen=True, kw_only=True)
class TableConfig:
    """Everything that defines one table.

    Attributes:
        name: the table's name (letters, digits, ``_`` and ``-``).
        capacity: rows kept; when full, the oldest row is overwritten (FIFO).
        sampler: a registered sampler's name (``uniform``, ``prioritized``,
            ``slice``, ``prioritized_slice``, ``fifo``, ``lifo``).
        alpha: priority exponent, P(i) = p_i^alpha / sum_k p_k^alpha (prioritized kinds).
        beta: importance-weight exponent (prioritized kinds).
        slice_len: steps per sampled slice (slice kinds; required there, refused elsewhere).
        strict_length: (slice kinds) ``False``: a slice may also start at the first
            stored step of any episode, however short, and is cut at the episode's
            last stored step (TorchRL's ``SliceSampler(strict_length=False)``); a
            sample stays ``[B, slice_len]``, each slice's window repeating its last
            real id past its end (see :mod:`replay_server.engine.samplers.episodes`).
        span_left: (``slice`` only) windows may also begin up to this many steps
            before an episode's first stored step, the steps before it cut
            (TorchRL's ``span=(left, right)``); in ``[0, slice_len - 1]``.
        span_right: (slice kinds) windows may end up to this many steps past an
            episode's last stored step, the steps past it cut: a slice has at
            least ``slice_len - span_right`` steps; in ``[0, slice_len - 1]``.
        episode_key: int64 column holding each row's episode id (slice kinds need it).
        done_key: bool column whose True ends an episode (optional column).
        truncated_key: bool column whose True also ends an episode (optional column).
        schema: columns declared up front (flat key -> FieldSpec); ``None``: the
            first insert fixes it.
        pin_memory: allocate storage in page-locked memory (needs an accelerator).
        seed: seed of the table's random generator; ``None``: nondeterministic.
        min_size_to_sample: samples wait until the table holds this many rows
            (Reverb's ``MinSize``); ``None``: 1 with ``samples_per_insert``,
            else no rate limiter at all.
        samples_per_insert: the ratio of sampled rows to inserted rows the rate
            limiter holds (Reverb's ``SampleToInsertRatio``); ``None``: no ratio limit.
        error_buffer: how far the ratio's count may drift either way before
            calls wait, in sampled rows (see :mod:`replay_server.engine.rate_limiter`);
            ``None``: ``max(1, samples_per_insert) * max(min_size_to_sample, 1000)``.
        max_times_sampled: a row drawn this many times is retired (no longer
            sampled; slice samplers: a slice drawn this many times is retired);
            0: no limit (``fifo``/``lifo``: 1).
        max_size: (tables whose rows leave when sampled: ``fifo``/``lifo``, or
            ``max_times_sampled``) inserts wait while the table holds more
            than ``max_size - rows`` rows; ``None``: they never wait, and the
            ring overwrites the oldest rows when full. At most ``capacity``.
        lease_timeout_s: (samplers that consume their rows: ``fifo``/``lifo``)
            seconds a sample's rows taken under a lease stay its taker's
            before they return to the queue unless acknowledged
            (:mod:`replay_server.engine.leases`); ``None``: 60.
        storage: every column's backend: ``memory`` (preallocated tensors in
            RAM; on a device table, in device memory) or ``memmap``
            (memory-mapped files under ``storage_dir``: the page cache decides
            what stays in RAM, so a table may be larger than RAM).
        column_storage: per-column backends overriding ``storage`` (flat key ->
            ``memory`` or ``memmap``); ``None``: none.
        storage_dir: the existing directory ``memmap`` columns keep their
            files in; only with a ``memmap`` column.
        n_step: (any sampler but ``fifo``/``lifo``) samples return n-step
            transitions built from the stored steps of each row's episode
            (see :mod:`replay_server.engine.readers.nstep`); 1: plain rows.
        gamma: the discount of the n-step return (``n_step > 1`` only), in [0, 1].
        reward_key: the column summed into the n-step return (``n_step > 1`` only).
        frame_stack_key: a stacked observation ``[stack, ...]`` stored one frame
            per step (with ``next.<key>`` when present), its stacks rebuilt at
            sample time (see :mod:`replay_server.engine.readers.framestack`);
            ``None``: off.
        frame_stack_fill: the frames before an episode's first step: ``repeat``
            its first frame, or ``zero``.
        compress_keys: columns whose rows are stored lz4-compressed, over their
            backend (see :mod:`replay_server.engine.storage.compressed`);
            ``None``: none.
        priority_mixing: (samplers with priorities and slices) ``eta``: priority
            updates are of whole slices (a batch's ids ``[B, slice_len]``, each
            row one slice as sampled, which the sampler checks) and give each
            slice's start ``eta * max + (1 - eta) * mean`` of its steps'
            priorities, as R2D2 does; ``None``: updates apply per row.
        device: where the table's batches are handed out and its ``memory``
            columns live: ``"cpu"`` (host memory, the default) or ``"cuda"`` /
            ``"cuda:N"`` (device memory: sampling gathers there; see
            :mod:`replay_server.engine.storage.device`). Checked against the
            machine when the table is made.
    """

    name: str
    capacity: int
    sampler: SamplerKind = SamplerKind.UNIFORM
    alpha: float = 0.6
    beta: float = 0.4
    slice_len: int | None = None
    strict_length: bool = True
    span_left: int = 0
    span_right: int = 0
    episode_key: str = "episode"
    done_key: str = "done"
    truncated_key: str = "truncated"
    schema: dict[str, FieldSpec] | None = field(default=None, hash=False)
    pin_memory: bool = False
    seed: int | None = None
    min_size_to_sample: int | None = None
    samples_per_insert: float | None = None
    error_buffer: float | None = None
    max_times_sampled: int = 0
    max_size: int | None = None
    lease_timeout_s: float | None = None
    storage: StorageKind = StorageKind.MEMORY
    storage_dir: str | None = None
    n_step: int = 1
    gamma: float = 0.99
    reward_key: str = "reward"
    frame_stack_key: str | None = None
    frame_stack_fill: str = "repeat"
    compress_keys: tuple[str, ...] | None = None
    device: str = "cpu"
    column_storage: dict[str, StorageKind] | None = field(default=None, hash=False)
    priority_mixing: float | None = None

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
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**128):
            raise ConfigError(f"{where}: seed must be an integer in [0, 2**128) or omitted, got "
                              f"{self.seed!r}")
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
            try:
                check_prefixes(self.schema)
            except ValueError as exc:
                raise ConfigError(f"{where}: schema: {exc}") from None
        self._check_flow_control(where)
        self._check_max_size(where)
        self._check_lease(where)
        self._check_storage(where)
        self._check_n_step(where)
        self._check_frame_stack(where)
        self._check_compression(where)
        self._check_device(where)
        self._check_priority_mixing(where)
        self._check_slice_shape(where)
        self._check_combinations(where)

    def _check_device(self, where: str) -> None:
        """Syntax and supported combinations only; the machine is asked when the table is made
        (:func:`~replay_server.engine.storage.placement.check_placement`)."""
        device = self.device
        if not isinstance(device, str) or not _DEVICE.fullmatch(device):
            raise ConfigError(f"{where}: device must be 'cpu', 'cuda' or 'cuda:N' (N a device "
                              f"index), got {device!r}")
        if device == "cpu":
            return

    @property
    def on_device(self) -> bool:
        """Whether the table's columns live in device memory (``device`` is not ``"cpu"``)."""
        return self.device != "cpu"

    def _check_compression(self, where: str) -> None:
        keys = self.compress_keys
        if keys is None:
            return
        if (not isinstance(keys, (list, tuple)) or not keys
                or not all(isinstance(k, str) and k for k in keys) or len(set(keys)) != len(keys)):
            raise ConfigError(f"{where}: compress_keys must be a non-empty list of distinct "
                              f"column names, got {keys!r}")
        object.__setattr__(self, "compress_keys", tuple(keys))

    def _check_frame_stack(self, where: str) -> None:
        if self.frame_stack_fill not in ("repeat", "zero"):
            raise ConfigError(f"{where}: frame_stack_fill must be 'repeat' or 'zero', got "
                              f"{self.frame_stack_fill!r}")
        key = self.frame_stack_key
        if key is None:
            return
        if not isinstance(key, str) or not key or key.startswith("next."):
            raise ConfigError(f"{where}: frame_stack_key must name the stacked observation "
                              f"(e.g. 'obs'; 'next.<key>' is stacked with it), got {key!r}")

    def _check_n_step(self, where: str) -> None:
        if not _is_int(self.n_step) or not 1 <= self.n_step <= min(self.capacity, 1000):
            raise ConfigError(f"{where}: n_step must be an integer in [1, min(capacity, 1000)] "
                              f"(1: plain rows), got {self.n_step!r}")
        if not _is_real(self.gamma) or not 0.0 <= self.gamma <= 1.0:
            raise ConfigError(f"{where}: gamma must be a number in [0, 1], got {self.gamma!r}")
        object.__setattr__(self, "gamma", float(self.gamma))
        if not isinstance(self.reward_key, str) or not self.reward_key:
            raise ConfigError(f"{where}: reward_key must be a non-empty string, got "
                              f"{self.reward_key!r}")

    def _check_max_size(self, where: str) -> None:
        """max_size bounds tables whose rows leave when sampled (a remover's)."""
        if self.max_size is None:
            return
        if self.removal_limit == 0:
            raise ConfigError(
                f"{where}: max_size={self.max_size!r} only applies where rows leave the table "
                f"when sampled (sampler 'fifo' or 'lifo', or max_times_sampled); without that "
                f"a table at max_size would stop taking inserts for good; remove max_size")
        if not _is_int(self.max_size) or not 1 <= self.max_size <= self.capacity:
            raise ConfigError(f"{where}: max_size must be an integer in [1, capacity="
                              f"{self.capacity}] or omitted, got {self.max_size!r}")

    def _check_lease(self, where: str) -> None:
        """lease_timeout_s applies where a sample takes its rows (a consuming sampler)."""
        timeout = self.lease_timeout_s
        if timeout is None:
            return
        if not self.sampler.traits.consumes:
            raise ConfigError(
                f"{where}: lease_timeout_s={timeout!r} only applies where a sample takes its "
                f"rows (sampler 'fifo' or 'lifo'): sampler {self.sampler.value!r} hands rows "
                f"out without taking them, so nothing is leased; remove lease_timeout_s")
        if not _is_real(timeout) or not 0 < timeout <= MAX_LEASE_TIMEOUT_S:
            raise ConfigError(f"{where}: lease_timeout_s must be a number of seconds in "
                              f"(0, {MAX_LEASE_TIMEOUT_S:g}] or omitted, got {timeout!r}")
        object.__setattr__(self, "lease_timeout_s", float(timeout))

    @property
    def effective_lease_timeout_s(self) -> float:
        """``lease_timeout_s`` with its default resolved."""
        return DEFAULT_LEASE_TIMEOUT_S if self.lease_timeout_s is None else self.lease_timeout_s

    def _check_storage(self, where: str) -> None:
        try:
            object.__setattr__(self, "storage", StorageKind(self.storage))
        except ValueError:
            kinds = ", ".join(k.value for k in StorageKind)
            raise ConfigError(
                f"{where}: storage must be one of {kinds}, got {self.storage!r}") from None
        overrides = self.column_storage
        if overrides is not None:
            if not isinstance(overrides, dict) or not overrides or not all(
                    isinstance(k, str) and k for k in overrides):
                raise ConfigError(f"{where}: column_storage must map column keys to storage "
                                  f"kinds, got {overrides!r}")
            try:
                object.__setattr__(self, "column_storage", {
                    key: StorageKind(kind) for key, kind in overrides.items()})
            except ValueError:
                kinds = ", ".join(k.value for k in StorageKind)
                raise ConfigError(f"{where}: column_storage values must be one of {kinds}, "
                                  f"got {overrides!r}") from None
        kinds = {self.storage, *(self.column_storage or {}).values()}
        if StorageKind.MEMMAP in kinds:
            if not isinstance(self.storage_dir, str) or not self.storage_dir:
                raise ConfigError(f"{where}: storage 'memmap' needs storage_dir, the directory "
                                  f"its files go in; got {self.storage_dir!r}")
        elif self.storage_dir is not None:
            raise ConfigError(f"{where}: storage_dir={self.storage_dir!r} is only used by "
                              f"storage 'memmap', and storage is {self.storage.value!r}; remove "
                              f"storage_dir or set storage = \"memmap\"")

    def backend_of(self, key: str) -> StorageKind:
        """The storage kind of column ``key`` (``column_storage``'s, else ``storage``)."""
        return (self.column_storage or {}).get(key, self.storage)

    def _check_flow_control(self, where: str) -> None:
        """Rate limiter and max_times_sampled: refuse settings that can never make progress."""
        if self.min_size_to_sample is not None and (
            not _is_int(self.min_size_to_sample)
            or not 1 <= self.min_size_to_sample <= self.capacity
        ):
            raise ConfigError(
                f"{where}: min_size_to_sample must be an integer in [1, capacity={self.capacity}] "
                f"(the table never holds more than capacity rows, so sampling would wait "
                f"forever), got {self.min_size_to_sample!r}"
            )
        spi = self.samples_per_insert
        if spi is not None:
            if not _is_real(spi) or not math.isfinite(spi) or spi <= 0:
                raise ConfigError(
                    f"{where}: samples_per_insert must be a finite number > 0, got {spi!r}"
                )
            object.__setattr__(self, "samples_per_insert", float(spi))
        buffer = self.error_buffer
        if buffer is not None:
            if spi is None:
                raise ConfigError(
                    f"{where}: error_buffer={buffer!r} only applies with samples_per_insert; "
                    f"set samples_per_insert or remove error_buffer"
                )
            if not _is_real(buffer) or not math.isfinite(buffer) or buffer <= 0:
                raise ConfigError(
                    f"{where}: error_buffer must be a finite number > 0, got {buffer!r}"
                )
            if buffer < max(1.0, spi):
                raise ConfigError(
                    f"{where}: error_buffer={buffer!r} is below max(1, samples_per_insert="
                    f"{spi!r}) = {max(1.0, spi)!r}: a single insert and a single sample could "
                    f"then both be blocked at once, forever (Reverb's rule)"
                )
            object.__setattr__(self, "error_buffer", float(buffer))
        limit = self.max_times_sampled
        if not _is_int(limit) or not 0 <= limit <= MAX_TIMES_SAMPLED:
            raise ConfigError(
                f"{where}: max_times_sampled must be an integer in [0, {MAX_TIMES_SAMPLED}] "
                f"(0: no limit), got {limit!r}"
            )

    def _check_priority_mixing(self, where: str) -> None:
        eta = self.priority_mixing
        if eta is None:
            return
        if not _is_real(eta) or not 0.0 <= eta <= 1.0:
            raise ConfigError(f"{where}: priority_mixing must be a number in [0, 1] or omitted, "
                              f"got {eta!r}")
        object.__setattr__(self, "priority_mixing", float(eta))
        traits = self.sampler.traits
        if not (traits.priorities and traits.slices):
            raise ConfigError(
                f"{where}: priority_mixing={eta!r} only applies to samplers with priorities and "
                f"slices (it mixes a slice's steps' priorities into its start's), and sampler "
                f"is {self.sampler.value!r}; remove priority_mixing or choose "
                f"'prioritized_slice'")

    def _check_slice_shape(self, where: str) -> None:
        """``strict_length``, ``span_left`` and ``span_right``: slice samplers only."""
        if not isinstance(self.strict_length, bool):
            raise ConfigError(f"{where}: strict_length must be true or false, got "
                              f"{self.strict_length!r}")
        for name in ("span_left", "span_right"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise ConfigError(f"{where}: {name} must be an integer >= 0, got {value!r}")
        partial = not self.strict_length or self.span_left or self.span_right
        if not self.sampler.is_slice:
            if partial:
                raise ConfigError(
                    f"{where}: strict_length, span_left and span_right shape slices, and "
                    f"sampler is {self.sampler.value!r}; remove them or choose sampler 'slice'")
            return
        assert self.slice_len is not None
        for name in ("span_left", "span_right"):
            value = getattr(self, name)
            if value >= self.slice_len:
                raise ConfigError(
                    f"{where}: {name} must be in [0, slice_len - 1 = {self.slice_len - 1}] (a "
                    f"slice keeps at least one step), got {value!r}")
        if self.span_left and self.sampler.traits.priorities:
            raise ConfigError(
                f"{where}: span_left={self.span_left!r} has no meaning with sampler "
                f"{self.sampler.value!r}, which draws a slice by the priority of its first "
                f"stored step (TorchRL's PrioritizedSliceSampler turns left spans off too); "
                f"use span_left = 0, or sampler 'slice'")

    @property
    def partial_slices(self) -> bool:
        """Whether a slice may be shorter than ``slice_len`` (``strict_length = false`` or a
        span): its window then repeats its last real id."""
        return bool(not self.strict_length or self.span_left or self.span_right)

    def _check_combinations(self, where: str) -> None:
        """The only combinations of features refused, each because it has no meaning
        (docs/engine.md, "What is refused"); every other combination composes."""
        kind = self.sampler.value
        if self.n_step > 1 and self.sampler.traits.consumes:
            raise ConfigError(
                f"{where}: n_step={self.n_step} has no meaning with sampler {kind!r}, which "
                f"hands a row out as soon as it arrives, before the later steps its n-step "
                f"return sums exist; use n_step = 1 or a sampler that keeps its rows")
        kinds = {self.storage, *(self.column_storage or {}).values()}
        if self.pin_memory and kinds == {StorageKind.MEMMAP}:
            raise ConfigError(
                f"{where}: pin_memory has no meaning with storage 'memmap', whose rows are "
                f"file pages that pinning would hold in RAM, which memmap exists to avoid; "
                f"remove pin_memory")
        spi, limit = self.samples_per_insert, self.removal_limit
        most = limit * (self.slice_len or 1)  # a slice's draw samples slice_len rows
        if limit and spi is not None and spi > most:
            raise ConfigError(
                f"{where}: samples_per_insert={spi!r} has no meaning with {self._limit_name}, "
                f"which lets a row be sampled at most {most} time{'s' if most > 1 else ''}, so "
                f"inserts would wait for samples that wait for inserts; lower samples_per_insert or raise the limit")

    @property
    def removal_limit(self) -> int:
        """Draws after which a row leaves the table: ``max_times_sampled``, else 1 for a
        sampler that consumes its rows (``fifo``/``lifo``), else 0 (rows only age out)."""
        if self.max_times_sampled:
            return self.max_times_sampled
        return 1 if self.sampler.traits.consumes else 0

    @property
    def _limit_name(self) -> str:
        if self.max_times_sampled:
            return f"max_times_sampled={self.max_times_sampled}"
        return f"sampler {self.sampler.value!r} (each row handed out once)"

    @property
    def rate_limited(self) -> bool:
        """Whether a rate limiter is configured (``min_size_to_sample``/``samples_per_insert``)."""
        return self.min_size_to_sample is not None or self.samples_per_insert is not None

    @property
    def effective_min_size_to_sample(self) -> int:
        """``min_size_to_sample`` with its default resolved (0: no rate limiter)."""
        if self.min_size_to_sample is not None:
            return self.min_size_to_sample
        return 1 if self.samples_per_insert is not None else 0

    @property
    def effective_error_buffer(self) -> float | None:
        """``error_buffer`` with its default resolved (``None``: no ratio limit)."""
        spi = self.samples_per_insert
        if spi is None:
            return None
        if self.error_buffer is not None:
            return self.error_buffer
        return max(1.0, spi) * max(self.effective_min_size_to_sample, DEFAULT_ERROR_ROWS)

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
            "strict_length": self.strict_length,
            "span_left": self.span_left,
            "span_right": self.span_right,
            "episode_key": self.episode_key,
            "done_key": self.done_key,
            "truncated_key": self.truncated_key,
            "min_size_to_sample": self.min_size_to_sample,
            "samples_per_insert": self.samples_per_insert,
            "error_buffer": self.error_buffer,
            "max_times_sampled": self.max_times_sampled,
            "max_size": self.max_size,
            "lease_timeout_s": self.lease_timeout_s,
            "storage": self.storage.value,
            "storage_dir": self.storage_dir,
            "n_step": self.n_step,
            "gamma": self.gamma,
            "reward_key": self.reward_key,
            "frame_stack_key": self.frame_stack_key,
            "frame_stack_fill": self.frame_stack_fill,
            "compress_keys": None if self.compress_keys is None else list(self.compress_keys),
            "device": self.device,
            "column_storage": None if self.column_storage is None else {
                key: kind.value for key, kind in self.column_storage.items()},
            "priority_mixing": self.priority_mixing,
        }


def default_table_configs(capacity: int = 100_000) -> list[TableConfig]:
    """The tables a server starts with when it is given no config: one per sampler kind.

    ``replay`` is prioritized (as in the design's examples); ``uniform``,
    ``slice``, ``prioritized_slice``, ``fifo`` and ``lifo`` are named after
    their sampler; slices are 32 steps long.
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
        TableConfig(name="fifo", capacity=capacity, sampler=SamplerKind.FIFO),
        TableConfig(name="lifo", capacity=capacity, sampler=SamplerKind.LIFO),
    ]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
