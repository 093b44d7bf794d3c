"""``rb.sampler``: a table's sampling settings under the names of TorchRL's sampler attributes.

TorchRL scripts anneal importance sampling through the buffer's sampler:
``rb.sampler.beta = x`` by hand, or TorchRL's ``ParameterScheduler`` /
``LinearScheduler(rb.sampler, param_name="beta", ...)``, which read and set
the attribute (a :class:`RemoteSampler` and the buffer itself are registered
as virtual subclasses of TorchRL's ``Sampler`` ABC, so the schedulers accept
either). :class:`RemoteSampler` reads ``alpha`` and ``beta`` from the table
and sets them on it (``ReplayClient.set_sampling``: from the next draw on,
kept in checkpoints). Its other attributes describe the table as TorchRL's
samplers do (``slice_len``, ``num_slices``, ``max_capacity``).

Thread-safety: as the client (each read or write is one call).
"""

from __future__ import annotations

import copyreg
from typing import Any

from replay_client.errors import NoPrioritiesError


class RemoteSampler:
    """The sampler of a :class:`~replay_client.torchrl.buffer.RemoteReplayBuffer`'s table.

    Args:
        buffer: the buffer (its client, table and what the table can do).
    """

    def __init__(self, buffer: Any) -> None:
        self._buffer = buffer

    def _exponents(self) -> tuple[float, float]:
        info = self._buffer.table_info(fresh=True)
        if not info.capabilities.priorities:
            raise NoPrioritiesError(f"table {info.name!r} has no priorities, so no alpha or "
                                    f"beta (sampler {info.sampler!r})")
        return info.alpha, info.beta

    @property
    def alpha(self) -> float:
        return self._exponents()[0]

    @alpha.setter
    def alpha(self, value: float) -> None:
        self._buffer.replay_client.set_sampling(self._buffer.table, alpha=value)

    @property
    def beta(self) -> float:
        return self._exponents()[1]

    @beta.setter
    def beta(self, value: float) -> None:
        self._buffer.replay_client.set_sampling(self._buffer.table, beta=value)

    @property
    def max_capacity(self) -> int:
        return self._buffer.table_info().capacity

    @property
    def slice_len(self) -> int | None:
        layout = self._buffer.slice_layout
        return None if layout is None else layout.slice_len

    @property
    def num_slices(self) -> int | None:
        layout = self._buffer.slice_layout
        return None if layout is None else layout.num_slices

    @property
    def traj_key(self) -> Any:
        """The key of trajectory ids the buffer splits by (``None``: by end flags)."""
        episodes = self._buffer._episodes
        return None if episodes is None else episodes.traj_key

    def __getattr__(self, name: str) -> Any:
        """Other settings of the TorchRL sampler the buffer was given (``span``, ``traj_key``,
        ...), read only; private state has no counterpart."""
        original = self.__dict__["_buffer"]._torchrl_sampler
        if name.startswith("_") or original is None:
            raise AttributeError(f"RemoteSampler has no attribute {name!r}")
        return getattr(original, name)

    def __repr__(self) -> str:
        info = self._buffer.table_info()
        return f"RemoteSampler(table={info.name!r}, sampler={info.sampler!r})"


def bind_to_table(sampler: Any, buffer: Any) -> None:
    """Make the TorchRL sampler object a buffer was built with speak for the buffer's table.

    TorchRL code keeps the sampler it passed and calls it: ``sampler.update_priority(index,
    p)``, ``sampler.beta = x``, ``ParameterScheduler(sampler, ...)``. Left alone, that object
    holds priorities of its own that no draw reads, and each such call would be a silent
    no-op. So its class is swapped for a subclass whose ``update_priority`` goes to
    ``buffer.update_priority`` and whose ``alpha``/``beta`` (when it has them) read and set
    the table's. Nothing else of the object changes. Cost: one class per TorchRL sampler
    class, made once.
    """
    cls = type(sampler)
    if not getattr(cls, "_speaks_for_a_table", False):
        sampler.__class__ = _table_class(cls)
    sampler.__dict__["_table_buffer"] = buffer


_table_classes: dict[type, type] = {}


def _new_object(cls: type, *args: Any) -> Any:
    return cls.__new__(cls, *args)


def _table_setting(name: str) -> property:
    """``alpha``/``beta`` of the table the sampler speaks for (read and set there)."""
    def get(self: Any) -> Any:
        return getattr(self._table_buffer.sampler, name)

    def set_(self: Any, value: Any) -> None:
        setattr(self._table_buffer.sampler, name, value)

    return property(get, set_)


def _table_class(cls: type) -> type:
    if cls not in _table_classes:
        def update_priority(self: Any, index: Any, priority: Any, **_: Any) -> None:
            self._table_buffer.update_priority(index, priority)

        def __reduce_ex__(self: Any, protocol: Any) -> Any:
            """Pickles as TorchRL's own sampler, without the buffer (whose unpickling binds
            its copy again)."""
            bound = self.__dict__.pop("_table_buffer", None)
            self.__class__ = cls
            try:
                reduced = list(cls.__reduce_ex__(self, protocol))  # type: ignore[call-arg]
                if reduced[0] is copyreg.__newobj__:  # type: ignore[attr-defined]  # pickle checks that class: ours, now
                    reduced[0] = _new_object
                if len(reduced) > 2 and reduced[2] is self.__dict__:
                    reduced[2] = dict(self.__dict__)
                return tuple(reduced)
            finally:
                self.__class__ = bound_class
                if bound is not None:
                    self.__dict__["_table_buffer"] = bound

        namespace: dict[str, Any] = {"_speaks_for_a_table": True, "__module__": __name__,
                                     "update_priority": update_priority,
                                     "__reduce_ex__": __reduce_ex__}
        for name in ("alpha", "beta"):
            if isinstance(getattr(cls, name, None), property):
                namespace[name] = _table_setting(name)
        bound_class = type(cls.__name__, (cls,), namespace)
        _table_classes[cls] = bound_class
    return _table_classes[cls]


_registered: set[type] = set()


def register_with_torchrl(buffer_class: type) -> None:
    """Make :class:`RemoteSampler` and ``buffer_class`` instances of TorchRL's ``Sampler``
    ABC (when torchrl is installed): TorchRL's ``ParameterScheduler`` takes a ``ReplayBuffer``
    or a ``Sampler`` and reads and sets ``alpha``/``beta`` on it, which both have."""
    if buffer_class in _registered:
        return
    _registered.add(buffer_class)
    try:
        from torchrl.data.replay_buffers.samplers import Sampler
    except ImportError:  # torchrl is optional
        return
    for cls in (RemoteSampler, buffer_class):
        Sampler.register(cls)
