"""Table configuration: the table's own options plus one spec per layer, frozen and validated.

Each layer owns its options (:mod:`replay_server.engine.options`): the sampler's
are its class's spec (``alpha``/``beta`` are the prioritized samplers',
``slice_len`` the slice samplers', ``lease_timeout_s`` the queues'), a storage
backend's are its spec (``storage_dir`` is ``memmap``'s), the readers' and the
codec's theirs. :class:`TableConfig` holds the table's own options and those
specs; it is built from the flat keys a ``[[tables]]`` entry has (each key
routed to the spec that owns it) and reads flat (``config.alpha``) the same
way. :func:`table_options` lists every key with its owner, default and doc:
the config file, ``check-config`` and the docs reference all read it.

A bad value raises :class:`~replay_server.errors.ConfigError` whose message
names the table, the field and the value; nothing is silently corrected.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field, fields
from difflib import get_close_matches
from typing import Any, ClassVar

from replay_proto.id_layout import SEGMENT_ROWS
from replay_proto.keys import check_prefixes
from replay_proto.scalars import is_int
from replay_server.engine.options import (
    LayerSpec,
    OptionDoc,
    RegisteredName,
    Registry,
    misplaced,
    option,
)
from replay_server.engine.rate_limiter import DEFAULT_ERROR_ROWS, MAX_TIMES_SAMPLED, FlowControl
from replay_server.engine.reader_options import FrameStackOptions, NStepOptions
from replay_server.engine.sampler_kinds import (
    DEFAULT_LEASE_TIMEOUT_S,
    MAX_LEASE_TIMEOUT_S,
    SAMPLERS,
    SamplerSpec,
    SamplerTraits,
)
from replay_server.engine.schema import FieldSpec
from replay_server.engine.storage_kinds import BACKENDS, CompressionOptions, StorageKind
from replay_server.errors import ConfigError

__all__ = ["DEFAULT_ERROR_ROWS", "DEFAULT_LEASE_TIMEOUT_S", "MAX_CAPACITY",
           "MAX_LEASE_TIMEOUT_S", "MAX_TIMES_SAMPLED", "SamplerKind", "StorageKind",
           "TableConfig", "default_table_configs", "table_options"]

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_\-]{0,127}")
_DEVICE = re.compile(r"cpu|cuda(:(0|[1-9][0-9]{0,3}))?")

MAX_CAPACITY = SEGMENT_ROWS
"""Rows per table, at most: one id segment's rows (2**40; ``replay_proto.id_layout``)."""


class SamplerKind(RegisteredName):
    """A registered sampler's name (``SamplerKind.PRIORITIZED``, ``SamplerKind("slice")``),
    and what its class declares."""

    registry: ClassVar[Registry[Any]] = SAMPLERS
    _made: ClassVar[dict[str, Any]] = {}

    @property
    def traits(self) -> SamplerTraits:
        return SAMPLERS[self.value].traits

    @property
    def options(self) -> type[SamplerSpec]:
        """The spec of the sampler's options."""
        return SAMPLERS[self.value].options

    @property
    def is_queue(self) -> bool:
        """Consume-once kinds: a sample takes the oldest (fifo) or newest (lifo) rows away."""
        return self.traits.consumes

    @property
    def is_prioritized(self) -> bool:
        return self.traits.priorities


_GROUPS: tuple[tuple[str, str, type[LayerSpec]], ...] = (
    ("flow", "rate limiter", FlowControl),
    ("returns", "n-step reader", NStepOptions),
    ("stacking", "frame-stack reader", FrameStackOptions),
    ("compression", "lz4 codec", CompressionOptions),
)
"""The specs every table has: (its field in TableConfig, its owner's name, its class)."""


def _spec(doc: str) -> Any:
    return field(default=None, metadata={"spec": doc}, hash=False, compare=True)


@dataclass(frozen=True, init=False)
class TableConfig:
    """Everything that defines one table: its own options and one spec per layer.

    Built from flat keywords, as a ``[[tables]]`` entry is written
    (``TableConfig(name="r", capacity=1000, sampler="prioritized", alpha=0.7)``):
    each key goes to the spec that owns it; a key no layer of this table
    owns is refused, naming the sampler or storage it belongs to (unless it
    is unset or at its default: it then says nothing; ``alpha`` and ``beta``
    are taken by every sampler, without effect where it has no priorities,
    as configs and checkpoints have always had them). Every option reads
    flat too (``config.alpha``): the owning spec's value, else (an option of
    a layer the table does not have) its declared default.
    :func:`table_options` documents every key.
    """

    name: str = option(None, "the table's name (letters, digits, '_' and '-')", required=True)
    capacity: int = option(None, "rows kept; when full, the oldest row is overwritten",
                           required=True)
    sampler: SamplerKind = option("uniform", "how a sample picks rows: a registered sampler")
    storage: StorageKind = option("memory", "every column's storage backend")
    column_storage: dict[str, StorageKind] | None = field(default=None, hash=False, metadata={
        "doc": "per-column backends overriding storage (key -> backend); unset: none"})
    episode_key: str = option("episode", "int64 column holding each row's episode id")
    done_key: str = option("done", "bool column whose True ends an episode")
    truncated_key: str = option("truncated", "bool column whose True also ends an episode")
    schema: dict[str, FieldSpec] | None = field(default=None, hash=False, metadata={
        "doc": "columns declared up front (key -> 'dtype[dims]'); unset: the first insert "
               "fixes them"})
    seed: int | None = option(None, "seed of the table's random generator; unset: "
                                    "nondeterministic")
    device: str = option("cpu", "where batches are handed out and memory columns live: "
                                "cpu, cuda or cuda:N")
    pin_memory: bool = field(default=False, metadata={"server": True})
    sampler_options: SamplerSpec = _spec("the sampler's")
    inert: dict[str, Any] = field(default=None, hash=False,  # type: ignore[arg-type]
                                  metadata={"spec": "options kept without effect"})
    storage_options: dict[str, LayerSpec] = field(default=None, hash=False,  # type: ignore
                                                  metadata={"spec": "each backend used's"})
    flow: FlowControl = _spec("rate limiter")
    returns: NStepOptions = _spec("n-step reader")
    stacking: FrameStackOptions = _spec("frame-stack reader")
    compression: CompressionOptions = _spec("lz4 codec")

    def __init__(self, *, name: str, capacity: int, **options: Any) -> None:
        _build(self, name, capacity, options)

    def __getattr__(self, key: str) -> Any:
        # Every option is a plain attribute once built (_flatten); this finds only an
        # option of a layer registered since, at its default.
        if key.startswith("_") or "sampler_options" not in self.__dict__:
            raise AttributeError(key)
        found = table_options().get(key)
        if found is None:
            raise AttributeError(f"TableConfig has no option {key!r}")
        return found[0][1].default

    def specs(self) -> list[LayerSpec]:
        """The layer specs of this table: the sampler's, each storage backend's, the rest."""
        return [self.sampler_options, *self.storage_options.values(),
                *(getattr(self, group) for group, _, _ in _GROUPS)]

    @property
    def on_device(self) -> bool:
        """Whether the table's columns live in device memory (``device`` is not ``"cpu"``)."""
        return self.device != "cpu"

    @property
    def effective_lease_timeout_s(self) -> float:
        """``lease_timeout_s`` with its default resolved."""
        timeout = self.lease_timeout_s
        return DEFAULT_LEASE_TIMEOUT_S if timeout is None else timeout

    def backend_of(self, key: str) -> StorageKind:
        """The storage kind of column ``key`` (``column_storage``'s, else ``storage``)."""
        return (self.column_storage or {}).get(key, self.storage)

    @property
    def partial_slices(self) -> bool:
        """Whether a slice may be shorter than ``slice_len`` (``strict_length = false`` or a
        span): its window then repeats its last real id."""
        return bool(not self.strict_length or self.span_left or self.span_right)

    @property
    def removal_limit(self) -> int:
        """Draws after which a row leaves the table: ``max_times_sampled``, else 1 for a
        sampler that consumes its rows (``fifo``/``lifo``), else 0 (rows only age out)."""
        if self.flow.max_times_sampled:
            return self.flow.max_times_sampled
        return 1 if self.sampler.traits.consumes else 0

    @property
    def rate_limited(self) -> bool:
        return self.flow.rate_limited

    @property
    def effective_min_size_to_sample(self) -> int:
        return self.flow.effective_min_size_to_sample

    @property
    def effective_error_buffer(self) -> float | None:
        return self.flow.effective_error_buffer

    @property
    def episode_end_keys(self) -> tuple[str, str]:
        """Columns whose True ends an episode, in the order they are checked."""
        return (self.done_key, self.truncated_key)

    def describe(self) -> dict[str, Any]:
        """The config as plain values, one per key of :func:`table_options` (for logs,
        ``info`` and checkpoints; an option of a layer the table lacks reads its default)."""
        return {key: _plain(getattr(self, key)) for key in _described_keys(_layers())}


def _layers() -> tuple[tuple[tuple[str, int], ...], ...]:
    """The registered samplers and storage backends now (names and objects): what
    :func:`table_options` derives the keys from besides the table's own fields."""
    return (tuple((name, id(kind)) for name, kind in SAMPLERS.items()),
            tuple((name, id(backend)) for name, backend in BACKENDS.items()))


@functools.lru_cache(maxsize=8)
def _described_keys(layers: tuple[tuple[tuple[str, int], ...], ...]) -> tuple[str, ...]:
    """:meth:`TableConfig.describe`'s keys for the layers registered (``layers``, from
    :func:`_layers`): :func:`table_options` walks every registry and dataclass field, 0.2
    ms an ``info`` call when it ran each time."""
    return tuple(key for key in table_options() if key not in ("schema", "seed"))


def _plain(value: Any) -> Any:
    if isinstance(value, RegisteredName):
        return value.value
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


def _own_fields() -> list[Any]:
    return [f for f in fields(TableConfig) if "spec" not in f.metadata
            and "server" not in f.metadata]


def table_options() -> dict[str, list[tuple[str, OptionDoc]]]:
    """Every ``[[tables]]`` key: its owners (``"table"``, ``"sampler 'slice'"``, ``"storage
    'memmap'"``, ``"rate limiter"``, ...) with the option as each declares it.

    Derived from the registries each time (a layer registered later is in it).
    """
    found: dict[str, list[tuple[str, OptionDoc]]] = {}
    for f in _own_fields():
        doc = f.metadata.get("doc", "")
        if f.name == "sampler":
            doc += f" ({SAMPLERS.names()})"
        elif f.name == "storage":
            doc += f" ({BACKENDS.names()})"
        required = f.metadata.get("required", False)
        found[f.name] = [("table", OptionDoc(f.name, f.default, doc, required))]
    owners: list[tuple[str, type[LayerSpec]]] = [(owner, spec) for _, owner, spec in _GROUPS]
    owners += [(f"sampler {kind!r}", cls.options) for kind, cls in SAMPLERS.items()]
    owners += [(f"storage {kind!r}", backend.options) for kind, backend in BACKENDS.items()]
    for owner, spec in owners:
        for doc in spec.options():
            found.setdefault(doc.name, []).append((owner, doc))
    return found


def layer_names() -> dict[str, str]:
    """The registered samplers and storage backends, by layer (``check-config`` lists them)."""
    return {"samplers": SAMPLERS.names(), "storage": BACKENDS.names()}


_Target = tuple[str, type[LayerSpec], Any]
"""Where routed keys go: (field, or ``storage:<kind>``; the spec's class; a spec given whole)."""


def _build(config: TableConfig, name: Any, capacity: Any, options: dict[str, Any]) -> None:
    """Route flat ``options`` to the specs that own them, check every value and the few
    combinations without meaning, and set the fields (see :class:`TableConfig`)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(
            f"table name {name!r} is invalid: use 1-128 letters, digits, '_' or '-'")
    where = f"table {name!r}"
    if not is_int(capacity) or not 1 <= capacity <= MAX_CAPACITY:
        raise ConfigError(
            f"{where}: capacity must be an integer in [1, {MAX_CAPACITY}], got {capacity!r}")
    own = {f.name: f.default for f in fields(TableConfig) if "spec" not in f.metadata}
    values = {key: options.pop(key, default) for key, default in own.items()
              if key not in ("name", "capacity")}
    values.update(name=name, capacity=capacity)
    values["sampler"] = _kind(SamplerKind, values["sampler"], where, "sampler")
    values["storage"] = _kind(StorageKind, values["storage"], where, "storage")
    values["column_storage"] = _column_storage(where, values["column_storage"])
    held = {key: options.pop(key) for key in ("sampler_options", "storage_options", "inert",
                                              *(g for g, _, _ in _GROUPS)) if key in options}
    for key, value in (held.get("inert") or {}).items():  # dataclasses.replace() gives them
        options.setdefault(key, value)
    storage_kinds = _used_backends(values)
    targets = _targets(values["sampler"], storage_kinds, held)
    routed, inert = _route(options, targets, where, values["sampler"], values["storage"])
    for target, cls, given in targets:
        values[target] = _spec_of(cls, given, routed[target], where, target, values["sampler"])
    values["storage_options"] = {k: values.pop(f"storage:{k}") for k in storage_kinds}
    values["inert"] = _checked_inert(inert, where, capacity)
    for key, value in values.items():
        object.__setattr__(config, key, value)
    for spec in config.specs():
        spec.check(where, config.capacity)  # each layer's values, normalised
    _flatten(config)
    _check(config, where)


def _targets(kind: SamplerKind, storage_kinds: list[str], held: dict[str, Any]
             ) -> list[_Target]:
    """The specs this table has: its sampler's, every group's and each used backend's."""
    targets: list[_Target] = [
        ("sampler_options", kind.options, held.get("sampler_options")),
        *((group, cls, held.get(group)) for group, _, cls in _GROUPS)]
    backends = held.get("storage_options") or {}
    return targets + [(f"storage:{k}", BACKENDS[k].options, backends.get(k))
                      for k in storage_kinds]


def _route(options: dict[str, Any], targets: list[_Target], where: str, kind: SamplerKind,
           storage: StorageKind) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Each key to the specs of ``targets`` that declare it, or to the inert options; a key
    none takes is refused, naming its owner (unless unset or at its default)."""
    routed: dict[str, dict[str, Any]] = {target: {} for target, _, _ in targets}
    inert: dict[str, Any] = {}
    for key, value in options.items():
        owners = [target for target, cls, _ in targets if key in cls.keys()]
        if owners:
            for target in owners:
                routed[target][key] = value
        elif _is_inert(key):
            inert[key] = value
        elif not _at_default(key, value):  # an option at its default says nothing
            raise _unknown(where, key, value, kind, storage)
    return routed, inert


def _spec_of(cls: type[LayerSpec], given: Any, routed: dict[str, Any], where: str,
             target: str, kind: SamplerKind) -> LayerSpec:
    """The spec of ``cls`` from a spec ``given`` whole (its values that ``cls`` declares) and
    the keys routed to it; a required option left unset is refused, naming its layer."""
    carried = {} if given is None else {
        k: v for k, v in given.values().items() if k in cls.keys()}
    if isinstance(given, LayerSpec) and type(given) is cls:
        carried = {k: getattr(given, k) for k in cls.keys()}
    spec = cls(**{**carried, **routed})
    owner = (f"sampler {kind.value!r}" if target == "sampler_options"
             else f"storage {target[8:]!r}" if target.startswith("storage:") else None)
    for doc in spec.options():
        if doc.required and getattr(spec, doc.name) is None and owner is not None:
            raise ConfigError(f"{where}: {owner} needs {doc.name}")
    return spec


def _flatten(config: TableConfig) -> None:
    """Each layer option also as a plain attribute of ``config`` (checked, normalised), so
    reading ``config.slice_len`` on the sample path costs what a field does."""
    own = {f.name for f in fields(TableConfig)}
    for key, owners in table_options().items():
        if key in own:
            continue
        value = next((getattr(spec, key) for spec in config.specs() if key in spec.keys()),
                     config.inert.get(key, owners[0][1].default))
        object.__setattr__(config, key, value)


def _kind(cls: Any, value: Any, where: str, what: str) -> Any:
    try:
        return cls(value)
    except (ValueError, TypeError):
        raise ConfigError(f"{where}: {what} must be one of {cls.registry.names()}, got "
                          f"{value!r}") from None


def _column_storage(where: str, overrides: Any) -> dict[str, StorageKind] | None:
    if overrides is None:
        return None
    if not isinstance(overrides, dict) or not overrides or not all(
            isinstance(k, str) and k for k in overrides):
        raise ConfigError(f"{where}: column_storage must map column keys to storage "
                          f"kinds, got {overrides!r}")
    try:
        return {key: StorageKind(kind) for key, kind in overrides.items()}
    except ValueError:
        raise ConfigError(f"{where}: column_storage values must be one of "
                          f"{BACKENDS.names()}, got {overrides!r}") from None


def _used_backends(values: dict[str, Any]) -> list[str]:
    used = {values["storage"], *(values["column_storage"] or {}).values()}
    return [kind for kind in BACKENDS if kind in used]


def _is_inert(key: str) -> bool:
    owners = table_options().get(key)
    return owners is not None and all(doc.inert for _, doc in owners)


def _checked_inert(inert: dict[str, Any], where: str, capacity: int) -> dict[str, Any]:
    """``inert`` options, checked and normalised by the spec of a sampler that owns them."""
    checked: dict[str, Any] = {}
    for key, value in inert.items():  # by the smallest spec declaring it (its own checks)
        cls = min((s.options for s in SAMPLERS.values() if key in s.options.keys()),
                  key=lambda spec: len(spec.keys()))
        spec = cls(**{key: value})
        spec.check(where, capacity)
        checked[key] = getattr(spec, key)
    return checked


def _at_default(key: str, value: Any) -> bool:
    owners = table_options().get(key)
    return value is None or (owners is not None and all(
        type(value) is type(doc.default) and value == doc.default for _, doc in owners))


def _unknown(where: str, key: str, value: Any, sampler: SamplerKind,
             storage: StorageKind) -> ConfigError:
    """A key this table's layers do not take: whose it is, or the close one meant."""
    owners = table_options().get(key)
    if owners:
        samplers = [o[9:-1] for o, _ in owners if o.startswith("sampler ")]
        if samplers:
            return misplaced(where, key, value, samplers, "sampler", sampler.value)
        backends = [o[9:-1] for o, _ in owners if o.startswith("storage ")]
        return misplaced(where, key, value, backends, "storage", storage.value)
    close = get_close_matches(key, sorted(table_options()), n=1, cutoff=0.75)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"{where}: unknown option {key!r}{hint}")


def _check(config: TableConfig, where: str) -> None:
    """The table's own values, then the only combinations refused (docs/engine.md, "What
    is refused")."""
    keys = (config.episode_key, config.done_key, config.truncated_key)
    for name, value in zip(("episode_key", "done_key", "truncated_key"), keys):
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{where}: {name} must be a non-empty string, got {value!r}")
    if len(set(keys)) != len(keys):
        raise ConfigError(f"{where}: episode_key, done_key and truncated_key must be "
                          f"different columns, got {keys!r}")
    seed = config.seed
    if seed is not None and (not is_int(seed) or not 0 <= seed < 2**128):
        raise ConfigError(f"{where}: seed must be an integer in [0, 2**128) or omitted, got "
                          f"{seed!r}")
    if not isinstance(config.pin_memory, bool):
        raise ConfigError(f"{where}: pin_memory must be true or false, got "
                          f"{config.pin_memory!r}")
    _check_schema(config.schema, where)
    if not isinstance(config.device, str) or not _DEVICE.fullmatch(config.device):
        raise ConfigError(f"{where}: device must be 'cpu', 'cuda' or 'cuda:N' (N a device "
                          f"index), got {config.device!r}")
    if config.max_size is not None:
        if config.removal_limit == 0:
            raise ConfigError(
                f"{where}: max_size={config.max_size!r} only applies where rows leave the "
                f"table when sampled (sampler 'fifo' or 'lifo', or max_times_sampled); "
                f"without that a table at max_size would stop taking inserts for good; "
                f"remove max_size")
        config.flow.check_max_size(where, config.capacity)
    _check_combinations(config, where)


def _check_schema(schema: Any, where: str) -> None:
    if schema is None:
        return
    if not isinstance(schema, dict) or not schema:
        raise ConfigError(f"{where}: schema must be a non-empty mapping of key -> FieldSpec")
    for key, spec in schema.items():
        if not isinstance(spec, FieldSpec):
            raise ConfigError(
                f"{where}: schema[{key!r}] must be a FieldSpec, got {type(spec).__name__}")
    try:
        check_prefixes(schema)
    except ValueError as exc:
        raise ConfigError(f"{where}: schema: {exc}") from None


def _check_combinations(config: TableConfig, where: str) -> None:
    """The three combinations of layers refused, each because it has no meaning; every
    other combination composes."""
    kind = config.sampler.value
    if config.n_step > 1 and config.sampler.traits.consumes:
        raise ConfigError(
            f"{where}: n_step={config.n_step} has no meaning with sampler {kind!r}, which "
            f"hands a row out as soon as it arrives, before the later steps its n-step "
            f"return sums exist; use n_step = 1 or a sampler that keeps its rows")
    if config.pin_memory and set(config.storage_options) == {"memmap"}:
        raise ConfigError(
            f"{where}: pin_memory has no meaning with storage 'memmap', whose rows are "
            f"file pages that pinning would hold in RAM, which memmap exists to avoid; "
            f"remove pin_memory")
    spi, limit = config.samples_per_insert, config.removal_limit
    most = limit * (config.slice_len or 1)  # a slice's draw samples slice_len rows
    if limit and spi is not None and spi > most:
        name = (f"max_times_sampled={config.max_times_sampled}" if config.max_times_sampled
                else f"sampler {kind!r} (each row handed out once)")
        raise ConfigError(
            f"{where}: samples_per_insert={spi!r} has no meaning with {name}, which lets a "
            f"row be sampled at most {most} time{'s' if most > 1 else ''}, so inserts would "
            f"wait for samples that wait for inserts; lower samples_per_insert or raise "
            f"the limit")


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
        TableConfig(name="prioritized_slice", capacity=capacity,
                    sampler=SamplerKind.PRIORITIZED_SLICE, slice_len=32),
        TableConfig(name="fifo", capacity=capacity, sampler=SamplerKind.FIFO),
        TableConfig(name="lifo", capacity=capacity, sampler=SamplerKind.LIFO),
    ]
