"""A buffer's transforms: applied to samples in order, their inverses to written data.

TorchRL's buffers run their transforms on what ``sample`` and ``rb[index]``
return and each transform's ``inv`` (in reverse order) on what ``extend`` and
``add`` write; ``append_transform(t, invert=True)`` swaps the two directions
of ``t``. Any callable works; one without ``inv`` leaves written data alone.

Thread-safety: changed by the buffer's owner, read by its calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from replay_client.errors import InvalidArgumentError


class _Inverted:
    """``transform`` with its directions swapped (``invert=True``)."""

    def __init__(self, transform: Any) -> None:
        self.transform = transform

    def __call__(self, data: Any) -> Any:
        return self.transform.inv(data)

    def inv(self, data: Any) -> Any:
        return self.transform(data)


class Transforms:
    """The ordered transforms of one buffer."""

    def __init__(self, first: Callable | None = None) -> None:
        self.items: list[Any] = [] if first is None else [first]

    def append(self, transform: Callable, invert: bool = False) -> None:
        self.items.append(_Inverted(transform) if invert else transform)

    def insert(self, index: int, transform: Callable, invert: bool = False) -> None:
        """Insert at ``index`` (``-len..len``, as TorchRL's ``Compose.insert``).

        Raises:
            InvalidArgumentError: ``index`` is out of that range (a ``ValueError``).
        """
        if not -len(self.items) <= index <= len(self.items):
            raise InvalidArgumentError(
                f"insert_transform index {index} is out of range: the buffer has "
                f"{len(self.items)} transforms, so the index is in [-{len(self.items)}, "
                f"{len(self.items)}]")
        self.items.insert(index, _Inverted(transform) if invert else transform)

    def forward(self, data: Any) -> Any:
        """What a sample becomes."""
        for transform in self.items:
            data = transform(data)
        return data

    def inverse(self, data: Any) -> Any:
        """What written data becomes (inverses, last transform first)."""
        for transform in reversed(self.items):
            inverse = getattr(transform, "inv", None)
            if inverse is not None:
                data = inverse(data)
        return data

    def share(self) -> None:
        """Share each transform's state across processes (TorchRL's rule: ``share_memory_()``
        where it has one; a transform that keeps write state without one is refused)."""
        for transform in self.items:
            inner = transform.transform if isinstance(transform, _Inverted) else transform
            parts = list(inner) if hasattr(inner, "transforms") else [inner]  # a Compose
            for part in parts:
                share = getattr(part, "share_memory_", None)
                if callable(share):
                    share()
                elif getattr(part, "requires_shared_write_state", False):
                    raise RuntimeError(
                        f"{type(part).__name__} keeps replay-buffer write state but does not "
                        f"implement share_memory_(): use a centralized writer, or a transform "
                        f"that supports shared replay-buffer write state")

    def __len__(self) -> int:
        return len(self.items)
