"""``RemoteReplayBuffer``: a table of a replay server behind TorchRL's replay-buffer API.

A TorchRL training script swaps its buffer in one line::

    rb = TensorDictPrioritizedReplayBuffer(alpha=0.6, beta=0.4, storage=LazyTensorStorage(N),
                                           batch_size=256, priority_key="td_error")
    rb = RemoteReplayBuffer("localhost:50051", "replay", batch_size=256, priority_key="td_error")

and keeps its loop: ``rb.extend(data)``, ``rb.add(td)``, ``rb.sample()``,
``rb.update_tensordict_priority(batch)``, ``rb.update_priority(index, priority)``,
``len(rb)``, ``for batch in rb``. Batches are TensorDicts with TorchRL's key
names: the data, ``"index"`` (ids to update priorities with) and, from a
prioritized table, ``"priority_weight"`` (importance weights; the key TorchRL
0.10+ samplers write and its losses read; ``weight_key="_weight"`` for older
scripts).

What differs from TorchRL (``docs/torchrl.md`` has the whole list): the
table (capacity, sampler, alpha, beta) is configured on the server;
``"index"`` holds row ids (int64, never reused), not storage positions;
a ``[n_envs, T]`` TensorDict is ``n_envs * T`` rows with each env's episodes
kept apart (:mod:`replay_proto.rows`), where TorchRL's one-dimensional
storage would keep ``n_envs`` rows of ``T`` steps; ``sample`` waits while
the table is empty (``wait``), where TorchRL raises.

Thread-safety: as a ``ReplayClient`` (safe to share), except ``extend`` and
``add``, whose episode tracking belongs to one writer.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from replay_client.client import ReplayClient
from replay_client.connection import CLIENT_TIMEOUT
from replay_client.errors import InvalidArgumentError, InvalidPriorityError
from replay_proto.batch import SampleBatch
from replay_proto.rows import EPISODE_KEY, EpisodeTracker, rows_of

METADATA_KEYS = ("index", "_weight", "priority_weight")
"""What a sample adds (ids, weights): never stored as data when a batch is extended again."""

PRIORITY_EPS = 1e-8
"""Added to ``abs(priority)``, as TorchRL's ``PrioritizedSampler`` does, so no row is never drawn."""


class RemoteReplayBuffer:
    """TorchRL's ``TensorDict(Prioritized)ReplayBuffer`` interface over one server table.

    Args:
        client: a :class:`~replay_client.ReplayClient`, or the server's ``host:port``.
        table: the table's name (its sampler decides uniform or prioritized).
        batch_size: default batch size of :meth:`sample` and iteration.
        priority_key: where :meth:`extend` and :meth:`update_tensordict_priority`
            read priorities (TorchRL's default ``"td_error"``).
        episode_key: the episode-id column ``[n_envs, T]`` batches get (the table's ``episode_key``).
        wait: :meth:`sample` waits while the table is empty (``False``: EmptyTableError).
        timeout: seconds a :meth:`sample` may take, waiting included (default: the client's).
        prefetch: batches iteration keeps in flight (it reads a stream).
        weight_key: where importance weights go (TorchRL's ``"priority_weight"``).
    """

    def __init__(self, client: ReplayClient | str, table: str, *, batch_size: int | None = None,
                 priority_key: str = "td_error", episode_key: str = EPISODE_KEY,
                 wait: bool = True, timeout: Any = CLIENT_TIMEOUT, prefetch: int = 2,
                 weight_key: str = "priority_weight") -> None:
        self.client = ReplayClient(client) if isinstance(client, str) else client
        self.table = table
        self.priority_key = priority_key
        self.episode_key = episode_key
        self.wait = wait
        self.timeout = timeout
        self.prefetch = prefetch
        self.weight_key = weight_key
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(
                batch_size, int) or batch_size < 1):
            raise InvalidArgumentError(f"batch_size must be an integer >= 1 or None, "
                                       f"got {batch_size!r}")
        self._batch_size = batch_size
        self._tracker = EpisodeTracker()
        self._prioritized: bool | None = None

    # ------------------------------------------------------------------ writing

    def extend(self, tensordicts: TensorDictBase, *, update_priority: bool | None = None
               ) -> torch.Tensor:
        """Insert the rows of ``tensordicts`` (its batch dims decide what a row is).

        Sets ``"index"`` in ``tensordicts`` (shaped like its batch dims) and
        returns the ids, flat. With ``priority_key`` present and a prioritized
        table, those priorities (``abs + eps``, reduced by max over trailing
        dims) go in with the rows, as TorchRL's ``extend`` does.

        Raises:
            InvalidArgumentError: not a TensorDict; SchemaMismatchError, ... from the server.
        """
        if not isinstance(tensordicts, TensorDictBase):
            raise InvalidArgumentError(
                f"RemoteReplayBuffer.extend takes a TensorDict, got {type(tensordicts).__name__} "
                f"(use ReplayClient.insert for plain mappings)")
        priorities = None
        if update_priority is not False and self.priority_key in tensordicts.keys(
                include_nested=True) and self._is_prioritized():
            rows = max(1, tensordicts.batch_size.numel())
            priorities = _priorities(tensordicts.get(self.priority_key), rows)
        data = tensordicts.exclude(*METADATA_KEYS)  # a re-inserted sample's ids and weights
        columns = rows_of(data, episode_key=self.episode_key, tracker=self._tracker)
        ids = self.client.insert(self.table, columns, priorities=priorities)
        if not tensordicts.is_locked:
            tensordicts.set("index", ids.reshape(tensordicts.batch_size))
        return ids

    def add(self, data: TensorDictBase) -> int:
        """Insert one transition (a TensorDict without batch dims); returns its id."""
        if not isinstance(data, TensorDictBase) or data.batch_dims:
            raise InvalidArgumentError(
                "RemoteReplayBuffer.add takes one transition: a TensorDict with batch_size [] "
                "(use extend for batches)")
        return int(self.extend(data)[0])

    # ----------------------------------------------------------------- sampling

    @property
    def batch_size(self) -> int | None:
        return self._batch_size

    def sample(self, batch_size: int | None = None, return_info: bool = False) -> Any:
        """One batch as a TensorDict: the data, ``"index"`` and (prioritized) the weights.

        ``return_info=True`` returns ``(batch, {"index": ..., "priority_weight": ...})``
        as TorchRL does.

        Raises:
            InvalidArgumentError: no batch size given here or at construction.
            EmptyTableError (``wait=False``), DeadlineExceededError, ...: from the server.
        """
        size = batch_size if batch_size is not None else self._batch_size
        if size is None:
            raise InvalidArgumentError(
                "sample() needs a batch size: pass one, or batch_size=... to RemoteReplayBuffer")
        batch = self.client.sample(self.table, size, wait=self.wait, timeout=self.timeout)
        td = self._tensordict(batch)
        if not return_info:
            return td
        info = {key: td.get(key) for key in ("index", self.weight_key) if key in td.keys()}
        return td, info

    def _tensordict(self, batch: SampleBatch) -> TensorDict:
        td = batch.to_tensordict(self.weight_key)
        if not self._is_prioritized():
            del td[self.weight_key]  # TorchRL's uniform samplers give no weights
        return td

    def __iter__(self) -> Iterator[TensorDict]:
        """Batches of ``batch_size`` for as long as the loop runs, read from a stream
        (``prefetch`` batches ahead; each yielded TensorDict is the caller's to keep)."""
        if self._batch_size is None:
            raise InvalidArgumentError("iterating needs batch_size=... at construction")

        def transform(batch: SampleBatch) -> TensorDict:
            return self._tensordict(batch).clone()

        yield from self.client.stream(self.table, self._batch_size, prefetch=self.prefetch,
                                      transform=transform, wait=self.wait)

    # --------------------------------------------------------------- priorities

    def update_priority(self, index: Any, priority: Any) -> None:
        """Set the priorities of the rows ``index`` names (``abs(priority) + eps``, as TorchRL;
        dims beyond ``index``'s reduced by max)."""
        ids = torch.as_tensor(index).detach().cpu()
        values = _priorities(priority, ids.numel()).reshape(ids.shape)
        if not self._is_prioritized():  # TorchRL warns and does nothing, and so do we
            warnings.warn(f"update_priority() on table {self.table!r}, whose sampler has no "
                          f"priorities: nothing to update", stacklevel=2)
            return
        self.client.update_priorities(self.table, ids, values)

    def update_tensordict_priority(self, data: TensorDictBase) -> None:
        """Update priorities from ``data[priority_key]`` for the rows of ``data["index"]``.

        Priorities with more dims than the batch (e.g. ``[B, 1]``) are reduced
        by max; a slice batch (``[B, slice_len]``) updates every step it holds.
        Does nothing for a table without priorities, as TorchRL's buffer does.
        """
        if not self._is_prioritized():
            return
        self.update_priority(data.get("index"), data.get(self.priority_key))

    # -------------------------------------------------------------------- state

    def __len__(self) -> int:
        return self.client.info()[self.table].size

    @property
    def write_count(self) -> int:
        """Rows written since the table was created (TorchRL's ``write_count``)."""
        return self.client.info()[self.table].counters["inserted"]

    def empty(self) -> None:
        """Remove every row (ids keep counting; old ones become stale)."""
        self.client.reset(self.table)

    def _is_prioritized(self) -> bool:
        if self._prioritized is None:
            self._prioritized = "prioritized" in self.client.info()[self.table].sampler
        return self._prioritized

    def __repr__(self) -> str:
        return (f"RemoteReplayBuffer({self.client.address!r}, table={self.table!r}, "
                f"batch_size={self._batch_size})")


def _priorities(value: Any, rows: int) -> torch.Tensor:
    """``[rows]`` float64 priorities: ``abs + eps``, trailing dims reduced by max."""
    tensor = torch.as_tensor(value).detach().cpu().to(torch.float64)
    if tensor.numel() == rows:
        flat = tensor.reshape(rows)
    elif tensor.dim() and tensor.numel() % rows == 0:
        flat = tensor.reshape(rows, -1).abs().amax(dim=1)
    else:
        raise InvalidPriorityError(
            f"priorities of shape {list(tensor.shape)} do not fit {rows} rows")
    return flat.abs() + PRIORITY_EPS
