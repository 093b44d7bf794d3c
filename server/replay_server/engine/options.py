"""Layer specs: each kind of layer declares its own options, registered by the name configs use.

A spec is a frozen dataclass whose fields are its options; each field carries
its default and a one-line doc (:func:`option`), and the spec's
:meth:`LayerSpec.check` validates them (a :class:`~replay_server.errors.ConfigError`
naming the table, the field and the value). A sampler's options live in the
sampler's module, a storage backend's in the backend's: an option that only
has meaning with another (``alpha`` with a prioritized sampler, ``storage_dir``
with ``memmap``) lives in that other's spec, so the config cannot hold it
where it means nothing.

:class:`Registry` maps names to layer classes (samplers, storage backends);
:class:`RegisteredName` is a name checked against one. Adding a layer is its
module plus one :meth:`Registry.register` call: the config keys, their
defaults, ``check-config``, the docs reference test and the composition
matrix all read the registry.

Thread-safety: specs are immutable; registering is meant for import time (a
table made while another thread registers may or may not see the new name).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, Generic, TypeVar

from replay_server.errors import ConfigError

T = TypeVar("T")


def option(default: Any, doc: str, *, required: bool = False, inert: bool = False) -> Any:
    """A spec field: its ``default`` (``None``: unset), its one-line ``doc``, whether a
    table with the layer must set it (``required``: the default is only its unset value),
    and whether a table without the layer takes it too, checked and kept but without
    effect (``inert``: configs set it on every table before options had owners, and
    checkpoints recorded it, so refusing it would break their files)."""
    if isinstance(default, (dict, list)):
        raise TypeError("an option's default must be immutable")
    return field(default=default, metadata={"doc": doc, "required": required, "inert": inert})


@dataclass(frozen=True)
class OptionDoc:
    """One config key as a spec declares it: name, default and its line of docs."""

    name: str
    default: Any
    doc: str
    required: bool = False
    inert: bool = False


@dataclass(frozen=True, kw_only=True)
class LayerSpec:
    """A layer's options (the fields of a subclass, each made by :func:`option`)."""

    @classmethod
    def options(cls) -> tuple[OptionDoc, ...]:
        """The options this spec declares, in declaration order."""
        return tuple(OptionDoc(f.name, None if f.default is MISSING else f.default,
                               f.metadata.get("doc", ""), f.metadata.get("required", False),
                               f.metadata.get("inert", False))
                     for f in fields(cls))

    @classmethod
    def keys(cls) -> frozenset[str]:
        return frozenset(f.name for f in fields(cls))

    def values(self) -> dict[str, Any]:
        """The options as plain values (``describe``, logs, checkpoints)."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    def check(self, where: str, capacity: int) -> None:
        """Refuse a bad value (``where`` names the table; ``capacity`` bounds lengths).

        Normalises in place where a value has one canonical type (an int
        ``alpha`` becomes a float), as a frozen dataclass's ``__post_init__``
        would. Raises ConfigError naming the field and the value.
        """

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, str):
        return str(value)
    return value


class Registry(Mapping[str, T], Generic[T]):
    """Layer classes by the name a config gives them, in registration order.

    Args:
        what: what the names name, for messages ("sampler", "storage").
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self._items: dict[str, T] = {}

    def register(self, name: str, item: T) -> T:
        """Add ``item`` under ``name``; a name already taken is refused (ValueError)."""
        if not isinstance(name, str) or not name.isidentifier() or not name.islower():
            raise ValueError(f"a {self.what} name must be a lowercase identifier, got {name!r}")
        if name in self._items:
            raise ValueError(f"{self.what} {name!r} is already registered")
        self._items[name] = item
        return item

    def unregister(self, name: str) -> None:
        del self._items[name]

    @contextmanager
    def registered(self, name: str, item: T) -> Iterator[T]:
        """``item`` registered for the block (a test's own layer), then removed."""
        self.register(name, item)
        try:
            yield item
        finally:
            self.unregister(name)

    def __getitem__(self, name: str) -> T:
        return self._items[name]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def names(self) -> str:
        """``"a, b, c"``: the registered names, for messages."""
        return ", ".join(self._items)


class _NameKind(type):
    """Iterating a :class:`RegisteredName` class gives one member per registered name, and
    ``Kind.UPPER`` names one (as an Enum's members read)."""

    registry: Registry[Any]

    def __iter__(cls) -> Iterator[Any]:
        return (cls(name) for name in cls.registry)

    def __len__(cls) -> int:
        return len(cls.registry)

    def __getattr__(cls, attribute: str) -> Any:
        name = attribute.lower()
        if attribute.isupper() and name in cls.__dict__.get("registry", {}):
            return cls(name)
        raise AttributeError(attribute)


class RegisteredName(str, metaclass=_NameKind):
    """A name found in a class's :attr:`registry`; equal to (and usable as) the plain string,
    one object per name (``kind is Kind.X`` holds). ``value`` is the string (as an Enum's)."""

    registry: ClassVar[Registry[Any]]
    _made: ClassVar[dict[str, Any]]

    def __new__(cls, name: Any) -> Any:
        if isinstance(name, cls):
            return name
        if not isinstance(name, str) or name not in cls.registry:
            raise ValueError(f"{name!r} is not a registered {cls.registry.what}")
        made = cls.__dict__["_made"]
        if name not in made:
            made[name] = super().__new__(cls, name)
        return made[name]

    @property
    def value(self) -> str:
        return str.__str__(self)

    def __repr__(self) -> str:
        return f"<{type(self).__name__}.{self.value.upper()}: {self.value!r}>"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.value,))


def misplaced(where: str, key: str, value: Any, owners: list[str], layer: str,
              chosen: str) -> ConfigError:
    """The error for an option given to a layer that does not declare it."""
    names = " or ".join(repr(o) for o in owners)
    return ConfigError(
        f"{where}: {key}={value!r} is only used by {layer} {names}, and {layer} is "
        f"{chosen!r}; remove {key} or choose {layer} {owners[0]!r}")
