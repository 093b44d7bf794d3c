"""Episode heads: where a left span's windows begin.

A slice table with ``span_left = l`` (TorchRL's ``span=(l, ...)``) also draws
windows that begin up to ``l`` steps before an episode's first stored step
(its *head*); the steps before it are cut, so such a window is the head's
slice shortened by 1 to ``l`` steps. Each head that is a slice start gives
``l`` such draws beside the ordinary one, so a uniform draw over
``starts + l * heads`` picks every window with the same probability, as
TorchRL's window offsets in ``[-l, ...]`` do within a trajectory.

:class:`EpisodeHeads` keeps which slots hold a head (one bool per slot) and the
set of heads that are starts (a :class:`~replay_server.engine.samplers.slotset.SlotSet`).
Memory: 9 bytes per slot (5 below 2**31 slots), only on tables with ``span_left``.

Not thread-safe: called under the table's lock.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from replay_server.engine.samplers.slotset import SlotSet
from replay_server.engine.snapshot import saved_copy


class EpisodeHeads:
    """Which slots hold an episode's first stored step, and which of those are starts."""

    def __init__(self, capacity: int) -> None:
        self._is_head = np.zeros(capacity, dtype=bool)
        self.drawable = SlotSet(capacity)
        """Heads that are slice starts: what a left window is drawn from."""

    def evict(self, slots: np.ndarray) -> None:
        """The rows in ``slots`` left (their slots now hold new rows)."""
        self.drawable.remove(slots)
        self._is_head[slots] = False

    def arrived(self, heads: np.ndarray, new_starts: np.ndarray, starts: SlotSet) -> None:
        """``heads`` became heads and ``new_starts`` starts (slots): draw the heads that
        are starts now."""
        self._is_head[heads] = True
        self.restore(np.concatenate((heads, new_starts)), starts)

    def restore(self, slots: np.ndarray, starts: SlotSet) -> None:
        """Draw those of ``slots`` that are heads and starts (and not drawn already)."""
        slots = np.unique(slots)
        slots = slots[self._is_head[slots] & starts.contains(slots)]
        self.drawable.add(slots[~self.drawable.contains(slots)])

    def clear(self) -> None:
        self._is_head.fill(False)
        self.drawable.clear()

    def state_dict(self, used: int) -> dict[str, Any]:
        return {"is_head": torch.from_numpy(saved_copy(self._is_head[:used])),
                "drawable": torch.from_numpy(saved_copy(self.drawable.members(), np.int64))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        is_head = state["is_head"].numpy()
        self._is_head.fill(False)
        self._is_head[: is_head.size] = is_head
        self.drawable.clear()
        self.drawable.add(state["drawable"].numpy())
