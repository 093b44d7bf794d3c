"""``RemoteReplayBuffer``: a table of a replay server behind TorchRL's replay-buffer API.

A TorchRL training script swaps its buffer in one line::

    rb = TensorDictPrioritizedReplayBuffer(alpha=0.6, beta=0.4, storage=LazyTensorStorage(N),
                                           batch_size=256, priority_key="td_error")
    rb = RemoteReplayBuffer("localhost:50051", "replay", alpha=0.6, beta=0.4,
                            storage=LazyTensorStorage(N), batch_size=256, priority_key="td_error")

and keeps its loop. The buffer follows TorchRL's semantics wherever it takes
TorchRL's names (``docs/torchrl.md`` has the conformance table):

* the storage and sampler objects are checked against the table (capacity,
  priorities, slices: a :class:`~replay_client.errors.TableMismatchError`
  names the config line to change); ``alpha``/``beta`` are set on the table;
* ``batch_size`` counts steps, slices included: a slice table's sample is
  TorchRL's flat ``[batch_size]`` with its trajectory markers
  (:mod:`~replay_client.torchrl.slices`);
* ``"index"`` holds storage positions, as TorchRL's (``0 .. capacity - 1``:
  arithmetic, histograms and ``rb[index]`` behave as there), and
  :data:`ID_KEY` the never-reused row ids beside it, which
  ``update_tensordict_priority`` uses, so an update for a row overwritten
  since its sample is ignored (and counted); ``update_priority`` takes ids or
  storage positions (:mod:`~replay_client.torchrl.positions`);
* ``extend`` past capacity keeps the newest rows; an empty buffer raises
  :class:`~replay_client.errors.EmptyBufferError` (a ``RuntimeError``) at
  once unless ``wait=True``;
* plain tensors, tensorclasses and tuples of tensors go in and come out as
  they were given (:mod:`~replay_client.torchrl.data_kinds`).

What cannot match raises a clear error naming the alternative; nothing
differs silently.

Thread-safety: as a ``ReplayClient`` (safe to share), except ``extend`` and
``add``, whose episode tracking belongs to one writer.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from replay_client.api import ReplayApi
from replay_client.client import ReplayClient
from replay_client.connection import CLIENT_TIMEOUT
from replay_client.errors import (
    EmptyBufferError,
    EmptyTableError,
    InvalidArgumentError,
    ReplayError,
    SchemaMismatchError,
    TableMismatchError,
)
from replay_client.id_positions import IdSegment, positions_of
from replay_client.table_info import TableInfo
from replay_client.torchrl import indexing, state
from replay_client.torchrl.components import (
    built,
    priority_options,
    request_of,
    row_priorities,
)
from replay_client.torchrl.data_kinds import DataKind
from replay_client.torchrl.positions import ID_KEY, as_index_array, split_index
from replay_client.torchrl.row_shape import RowShape, expand_right
from replay_client.torchrl.sampler_view import (
    RemoteSampler,
    bind_to_table,
    register_with_torchrl,
)
from replay_client.torchrl.transforms import Transforms
from replay_feed.eager import runs_eagerly
from replay_proto.batch import SampleBatch, check_extras_names
from replay_proto.keys import unflatten
from replay_proto.rows import EpisodeTracker
from replay_proto.scalars import is_int

METADATA_KEYS = ("index", ID_KEY, "_weight", "priority_weight")
"""What a sample adds (positions, ids, weights): never stored as data when a batch is
extended again."""

INSERT_BYTES = 16 << 20
"""Bytes of rows one insert call carries at most (``extend`` splits larger data)."""


class RemoteReplayBuffer:
    """TorchRL's ``TensorDict(Prioritized)ReplayBuffer`` interface over one server table.

    Args:
        client: a replay client (:class:`~replay_client.api.ReplayApi`: one server's; a
            sharded one's positions are its shards' rings end to end, so ``rb[index]`` reads
            from each shard; it refuses writes by position), or the server's ``host:port``.
        table: the table's name (its config decides capacity and sampler).
        storage, sampler, writer: TorchRL's objects, checked against the table
            (:mod:`~replay_client.torchrl.components`); ``None``: the table's.
        batch_size: default batch size of :meth:`sample` and iteration, in steps.
        priority_key: where :meth:`extend` and :meth:`update_tensordict_priority`
            read priorities (TorchRL's default ``"td_error"``).
        alpha, beta: set on a prioritized table (``None``: the table's, or the sampler's).
        transform: applied to samples (its ``inv`` to written data), as TorchRL's.
        pin_memory: samples in page-locked memory when an accelerator is present.
        prefetch: batches iteration keeps in flight (it reads a stream).
        include_info: put ``"index"``, the weights and slice markers in samples
            (TorchRL's ``TensorDictReplayBuffer``); ``False``: samples are the data
            alone and ``extend`` leaves the data untouched (TorchRL's ``ReplayBuffer``).
        generator: seeds the table's random generator with its ``initial_seed()``
            (:meth:`set_rng`): the same seed and data give the same draws.
        wait: :meth:`sample` on an empty table waits for rows (up to ``timeout``)
            instead of raising :class:`~replay_client.errors.EmptyBufferError`.
        timeout: seconds a call may take (default: the client's).
        weight_key: where importance weights go (TorchRL's ``"priority_weight"``).
        **options: TorchRL's other buffer options: ``eps`` and ``reduction`` (how
            written priorities become one per row), options that mean nothing for a
            table (``shared``, ``compilable``, ...; accepted) and options with no
            server counterpart (refused unless left at TorchRL's default, naming
            the alternative): :mod:`~replay_client.torchrl.components`.

    Raises:
        TableMismatchError: the table cannot stand for ``storage``/``sampler``.
        UnsupportedComponentError: a TorchRL part with no server counterpart.
        UnknownTableError: no such table.
    """

    def __init__(self, client: ReplayApi | str, table: str, *, storage: Any = None,
                 sampler: Any = None, writer: Any = None, batch_size: int | None = None,
                 priority_key: str = "td_error", alpha: float | None = None,
                 beta: float | None = None, transform: Callable | None = None,
                 pin_memory: bool = False, prefetch: int | None = None,
                 include_info: bool = True, generator: torch.Generator | None = None,
                 wait: bool = False, timeout: Any = CLIENT_TIMEOUT,
                 weight_key: str = "priority_weight", **options: Any) -> None:
        self.replay_client = ReplayClient(client) if isinstance(client, str) else client
        self.table = table
        if batch_size is not None and (not is_int(batch_size) or batch_size < 1):
            raise InvalidArgumentError(f"batch_size must be an integer >= 1 or None, "
                                       f"got {batch_size!r}")
        self._batch_size = batch_size
        self.priority_key = priority_key
        self.include_info = include_info
        self.wait = wait
        self.timeout = timeout
        self.prefetch = prefetch
        self.pin_memory = pin_memory
        self.weight_key = weight_key
        self._info: TableInfo | None = None
        self._segments: dict[tuple[int, int], IdSegment] = {}
        self._seed: int | None = None  # the generator's seed, when one was given
        factory = options.pop("transform_factory", None)
        if factory is not None:
            transform = factory()
        self._collate = options.pop("collate_fn", None)
        self._delayed_init = bool(options.get("delayed_init", False))
        self._write_base = 0  # write_count at the last empty() (TorchRL's count starts over)
        self._priority = priority_options(sampler, options)
        self._torchrl_sampler = built(sampler)
        info = self.table_info()
        caps = info.capabilities
        request = request_of(storage=storage, sampler=sampler, writer=writer,
                             batch_size=batch_size, alpha=alpha, beta=beta)
        if storage is not None or sampler is not None:
            problems = request.problems(info)
            if problems:
                raise TableMismatchError("; ".join(problems))
        if caps.priorities and (request.alpha is not None or request.beta is not None):
            self.replay_client.set_sampling(table, alpha=request.alpha, beta=request.beta)
        self.slice_layout, self._episodes = request.read_shape(info)
        self._tracker = EpisodeTracker()
        self._kind = DataKind()
        self._rows = RowShape(steps=caps.episodes)
        self._transforms = Transforms(transform)
        self.shared = bool(options.pop("shared", False))
        if self.shared:
            self._transforms.share()
        self._shut_down = False
        if generator is not None:
            self.set_rng(generator)
        register_with_torchrl(type(self))
        self._sampler_bound = sampler is not None and self._torchrl_sampler is sampler
        if self._sampler_bound:  # the caller's object: its update_priority reaches the table
            bind_to_table(sampler, self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickled (TorchRL pickles buffers to other processes): the copy of the sampler
        speaks for the table too."""
        self.__dict__.update(state)
        if state.get("_sampler_bound"):
            bind_to_table(self._torchrl_sampler, self)

    # ------------------------------------------------------------------ table

    @runs_eagerly
    def table_info(self, fresh: bool = False) -> TableInfo:
        """The table's info (settings cached; ``fresh``: sizes and counters as of now)."""
        if self._info is None or fresh:
            self._info = self.replay_client.info()[self.table]
            self._segments.update({(s.shard, s.incarnation): s for s in self._info.id_segments})
        return self._info

    def positions(self, ids: torch.Tensor) -> torch.Tensor:
        """Storage positions (TorchRL's ``"index"``) of the stored rows ``ids`` name, shaped
        like ``ids``: computed from the id segments ``info`` reports (asked again only when
        an id is of a segment not seen yet: after a server restart). Over shards, the
        shards' positions laid end to end (:mod:`replay_client.id_positions`).

        Raises:
            ReplayError: an id of no segment the table reports (not an id of this table).
        """
        segments = tuple(self._segments.values())
        found = positions_of(ids.cpu().numpy(), segments)
        if (found < 0).any():
            self.table_info(fresh=True)
            found = positions_of(ids.cpu().numpy(), tuple(self._segments.values()))
            if (found < 0).any():
                raise ReplayError(
                    f"id {int(ids.reshape(-1)[torch.from_numpy(found.reshape(-1) < 0)][0])} "
                    f"belongs to no id segment of table {self.table!r}: not an id of this table")
        return torch.from_numpy(found).to(ids.device)

    @property
    def _prioritized(self) -> bool:
        return self.table_info().capabilities.priorities

    @property
    def sampler(self) -> RemoteSampler:
        """The table's sampling settings (``rb.sampler.beta = x`` anneals it)."""
        return RemoteSampler(self)

    @property
    def storage(self) -> indexing.RemoteStorage:
        """The table's rows by storage position (``len``, ``max_size``, ``[index]``)."""
        return indexing.RemoteStorage(self)

    alpha = property(lambda self: self.sampler.alpha,
                     lambda self, value: setattr(self.sampler, "alpha", value),
                     doc="The table's alpha (TorchRL's schedulers may set it on the buffer).")
    beta = property(lambda self: self.sampler.beta,
                    lambda self, value: setattr(self.sampler, "beta", value),
                    doc="The table's beta (TorchRL's schedulers may set it on the buffer).")

    def set_rng(self, generator: torch.Generator) -> None:
        """Seed the table's draws with ``generator.initial_seed()`` (draws happen on the server,
        so the generator itself is not advanced); saving the buffer derives the seeds it sets
        from this one (:mod:`~replay_client.torchrl.state`)."""
        self._seed = int(generator.initial_seed())
        self.replay_client.set_sampling(self.table, seed=self._seed)

    # ---------------------------------------------------------------- writing

    @runs_eagerly
    def extend(self, data: Any, *, update_priority: bool | None = None) -> torch.Tensor:
        """Insert the rows of ``data`` (a TensorDict's batch dims decide what a row is).

        Returns the rows' storage positions, flat, as TorchRL's; a TensorDict
        also gets them as ``"index"`` and the rows' ids as :data:`ID_KEY` (shaped
        like its batch dims) unless ``include_info=False``. With
        ``priority_key`` present and a prioritized table, those priorities
        (``abs + eps``, reduced by max over trailing dims) go in with the rows.
        Data larger than the table keeps its newest rows, as TorchRL's ring does.

        Raises:
            InvalidArgumentError: data of a kind a table cannot store (or another kind
                than this buffer holds); SchemaMismatchError, ... from the server.
        """
        return self._write(data, single=False, update_priority=update_priority)

    @runs_eagerly
    def add(self, data: Any) -> int:
        """Insert one element, as TorchRL's ``add``: a transition (a TensorDict with batch
        size ``[]``), or one row of a buffer whose rows have their own batch dims; returns its id.
        A TensorDict with batch dims is one element too, with TorchRL's warning (``extend``
        writes many). Returns its storage position, as TorchRL's."""
        if (isinstance(data, TensorDictBase) and data.batch_dims
                and os.environ.get("RL_WARNINGS", "1") != "0"):
            warnings.warn(f"Using `add()` with a TensorDict that has batch_size="
                          f"{data.batch_size}: it is stored as one element. Use `extend()` to "
                          f"add multiple elements (TorchRL's warning; RL_WARNINGS=0 silences it).", UserWarning, stacklevel=2)
        return int(self._write(data, single=True, update_priority=None)[0])

    def _write(self, data: Any, *, single: bool, update_priority: bool | None) -> torch.Tensor:
        td = self._transforms.inverse(self._kind.encode(data, single=single))
        if single:
            td = td.unsqueeze(0)
            self._rows.wrote(td)
        rows_td = td.exclude(*METADATA_KEYS)  # a re-inserted sample's ids and weights
        if not rows_td.keys():
            raise InvalidArgumentError(
                f"{'add' if single else 'extend'}() of data with no entries (a TensorDict of "
                f"batch_size={list(td.batch_size)} and no keys): a table stores columns, and "
                f"a row needs at least one; write the data's keys with it")
        if self._episodes is not None:
            rows_td = self._episodes.fill(rows_td)
        columns = self._rows.columns(rows_td, self.table_info().episode_key, self._tracker)
        priorities = None
        if update_priority is not False and self._prioritized and self.priority_key in td.keys(
                include_nested=True):
            rows = next(iter(columns.values())).shape[0]
            priorities = row_priorities(td.get(self.priority_key), rows, self._priority)
        try:
            ids = self._insert(columns, priorities)
        except SchemaMismatchError as exc:
            raise SchemaMismatchError(
                f"{exc}. A table's columns are fixed by its first write (TorchRL's storages "
                f"take new keys later): write every key each time, or rb.empty() first (it "
                f"forgets the schema)") from None
        positions = self.positions(ids)
        target = data if isinstance(data, TensorDictBase) else None
        if self.include_info and target is not None and not target.is_locked:
            shaped = target.unsqueeze(0) if single else target
            target.set("index", self._rows.index(positions, shaped).reshape(target.batch_size))
            target.set(ID_KEY, self._rows.index(ids, shaped).reshape(target.batch_size))
        return positions

    def _insert(self, columns: dict[str, torch.Tensor], priorities: torch.Tensor | None
                ) -> torch.Tensor:
        """Insert in calls of at most ``capacity`` rows and :data:`INSERT_BYTES`."""
        rows = next(iter(columns.values())).shape[0] if columns else 0
        row_bytes = sum(c[:1].numel() * c.element_size() for c in columns.values()) or 1
        step = max(1, min(self.table_info().capacity, INSERT_BYTES // row_bytes))
        if rows <= step:
            return self.replay_client.insert(self.table, columns, priorities=priorities)
        ids = []
        for start in range(0, rows, step):
            part = {k: v[start:start + step] for k, v in columns.items()}
            ids.append(self.replay_client.insert(self.table, part, priorities=None if priorities is None
                                          else priorities[start:start + step]))
        return torch.cat(ids)

    # --------------------------------------------------------------- sampling

    @property
    def batch_size(self) -> int | None:
        return self._batch_size

    @runs_eagerly
    def sample(self, batch_size: int | None = None, return_info: bool = False,
               include_info: bool | None = None) -> Any:
        """One batch: the data and (``include_info``) ``"index"`` (storage positions),
        :data:`ID_KEY` (ids), weights, slice markers.

        ``return_info=True`` returns ``(batch, info)`` as TorchRL does;
        ``include_info`` overrides the buffer's for this call.

        Raises:
            InvalidArgumentError: no batch size, or not a whole number of slices.
            EmptyBufferError: nothing to sample (``wait=False``); DeadlineExceededError, ...
        """
        if self._shut_down:
            raise RuntimeError("A shut down replay buffer cannot be sampled.")
        size = batch_size if batch_size is not None else self._batch_size
        if size is None:
            raise InvalidArgumentError(
                "sample() needs a batch size: pass one, or batch_size=... to RemoteReplayBuffer")
        draws = size if self.slice_layout is None else self.slice_layout.slices_for(size)
        try:
            batch = self.replay_client.sample(self.table, draws, wait=self.wait, timeout=self.timeout)
        except EmptyTableError as exc:
            raise EmptyBufferError(f"Cannot sample from an empty storage: {exc} "
                                   f"(RemoteReplayBuffer(..., wait=True) waits for rows "
                                   f"instead)") from None
        data, info = self._output(batch, include_info)
        return (data, info) if return_info else data

    def _output(self, batch: SampleBatch,
                include_info: bool | None = None) -> tuple[Any, dict[Any, torch.Tensor]]:
        prioritized = self._prioritized
        weights: torch.Tensor | None
        if self.slice_layout is None:
            columns, ids, weights, markers = batch.columns, batch.ids, batch.weights, {}
        else:
            steps = self.slice_layout.cut(batch, weights=prioritized)
            columns, ids, weights, markers = steps.columns, steps.ids, steps.weights, steps.markers
        check_extras_names(columns, self.weight_key)
        if self._episodes is not None:
            columns = self._episodes.strip(columns)
        info: dict[Any, torch.Tensor] = {"index": self.positions(ids), ID_KEY: ids}
        if prioritized and weights is not None:  # TorchRL's uniform samplers give no weights
            info[self.weight_key] = weights
        info.update(markers)
        with_info = self.include_info if include_info is None else include_info
        # Each TensorDict operation costs about as much as a small tensor's copy: the sample
        # is made once, from plain dicts, its info in it unless something comes in between.
        nested = unflatten(columns)
        direct = (with_info and self._kind.name in (None, "tensordict") and not self._rows.restores
                  and self._collate is None and not self._transforms.items)
        if direct:
            for key, value in info.items():
                _put(nested, key, value)
        data = TensorDict(nested, batch_size=ids.shape, device=ids.device)
        if not direct:
            data = self._rows.restore(data)  # stored flags as stored
            if self._collate is not None:
                data = self._collate(data)
            data = self._transforms.forward(data)
            if self._kind.name in (None, "tensordict") and with_info:
                data.update({key: expand_right(value, data.batch_size)
                             for key, value in info.items()})
        out = self._kind.decode(data)
        if self.pin_memory and torch.cuda.is_available():
            out = out.pin_memory()
        return out, info

    def __iter__(self) -> Iterator[Any]:
        """Batches of ``batch_size`` for as long as the loop runs, read from a stream
        (``prefetch`` batches ahead). Each one is the caller's to keep: it is
        copied out of the stream's reused buffers before the next is asked for."""
        if self._batch_size is None:
            raise InvalidArgumentError("iterating needs batch_size=... at construction")
        size = self._batch_size
        draws = size if self.slice_layout is None else self.slice_layout.slices_for(size)
        stream = self.replay_client.stream(self.table, draws, prefetch=self.prefetch or None,
                                    wait=self.wait)
        try:
            for batch in stream:
                yield self._output(batch.with_tensors([t.clone() for t in batch.tensors()]))[0]
        except EmptyTableError as exc:
            raise EmptyBufferError(str(exc)) from None
        finally:
            stream.close()

    # ------------------------------------------------------------- priorities

    @runs_eagerly
    def update_priority(self, index: Any, priority: Any) -> None:
        """Set the priorities of the rows ``index`` names: ids (a sample's ``"index"``) or
        storage positions (``abs(priority) + eps``, as TorchRL; dims beyond
        ``index``'s reduced by max).

        Raises:
            InvalidArgumentError: a position that holds no row, or ids and positions
                mixed. InvalidIdsError: an id the table never issued.
        """
        values = as_index_array(index, 0)
        kind = split_index(values)
        priorities = row_priorities(priority, values.size, self._priority)
        if not self._prioritized:  # TorchRL warns and does nothing, and so do we
            warnings.warn(f"update_priority() on table {self.table!r}, whose sampler has no "
                          f"priorities: nothing to update", stacklevel=2)
            return
        ids = (torch.from_numpy(values) if kind == "ids"
               else self.replay_client.read(self.table, positions=values, columns=False).ids)
        self.replay_client.update_priorities(self.table, ids, priorities)

    @runs_eagerly
    def update_tensordict_priority(self, data: TensorDictBase) -> None:
        """Update priorities from ``data[priority_key]`` for the rows ``data[ID_KEY]`` names
        (the ids a sample carries beside ``"index"``; without them, ``data["index"]``'s
        storage positions), so a row overwritten since it was sampled is left alone (the
        server ignores and counts the update) where TorchRL's would update its newer row.

        Priorities with more dims than the batch (e.g. ``[B, 1]``) are reduced
        by max. Does nothing for a table without priorities, as TorchRL's buffer does.
        """
        if not self._prioritized:
            return
        index = data.get(ID_KEY, None)
        if index is None:
            index = data.get("index")
        while index.dim() > 1 and self._rows.dims:  # rows with their own dims: one id each
            index = index[..., 0]
        self.update_priority(index, data.get(self.priority_key))

    # ------------------------------------------------------------------ state

    def __len__(self) -> int:
        return self.table_info(fresh=True).size

    @property
    def write_count(self) -> int:
        """Rows written to the table since this buffer last emptied it (since it was created,
        if never): TorchRL's ``write_count``."""
        return self.table_info(fresh=True).counters["inserted"] - self._write_base

    @property
    def initialized(self) -> bool:
        """TorchRL's: the storage holds its layout (here: the table's schema is fixed), or was
        made without ``delayed_init``."""
        return not self._delayed_init or bool(self.table_info(fresh=True).schema)

    @runs_eagerly
    def empty(self, empty_write_count: bool = True) -> None:
        """Remove every row and forget the schema: the buffer starts over (and
        ``write_count`` from 0, unless ``empty_write_count=False``, as TorchRL's)."""
        indexing.reset(self)
        if empty_write_count:
            self._write_base = self.table_info(fresh=True).counters["inserted"]
        self._tracker = EpisodeTracker()
        self._kind = DataKind()
        self._rows.reset()

    @property
    def writer(self) -> Any:
        """TorchRL's writer object has no counterpart: refused, naming what stands for it."""
        raise AttributeError(
            "RemoteReplayBuffer has no writer object: the table's ring is its writer (TorchRL's "
            "RoundRobinWriter: when full, the oldest rows are overwritten); use rb.extend() "
            "to write, rb.write_count and len(rb) to count")

    __getitem__ = runs_eagerly(indexing.get_rows)
    __setitem__ = runs_eagerly(indexing.set_rows)
    set_ = indexing.set_column
    set_at_ = indexing.set_column_at
    update_ = indexing.update_columns
    stats = state.stats
    state_dict = state.state_dict
    load_state_dict = state.load_state_dict
    dumps = state.dumps
    loads = state.loads
    save = state.dumps
    load = state.loads
    dump = state.dumps
    read_all_in_order = indexing.read_all_in_order
    query = indexing.query
    write_all = indexing.write_all

    @property
    def transform(self) -> Transforms:
        """The transforms samples go through (``append_transform``, ``insert_transform``)."""
        return self._transforms

    def append_transform(self, transform: Callable, *, invert: bool = False
                         ) -> RemoteReplayBuffer:
        """Apply ``transform`` to samples (after the others; its ``inv`` to written data)."""
        self._transforms.append(transform, invert)
        if self.shared:
            self._transforms.share()
        return self

    def insert_transform(self, index: int, transform: Callable, *, invert: bool = False
                         ) -> RemoteReplayBuffer:
        self._transforms.insert(index, transform, invert)
        if self.shared:
            self._transforms.share()
        return self

    def share(self, shared: bool = True) -> RemoteReplayBuffer:
        """TorchRL's ``share``: the table is shared already (every process that connects uses
        it; the buffer pickles as its client's settings), so only the transforms are
        shared: their ``share_memory_()`` is called (a transform that keeps write state
        without one is refused, as TorchRL refuses it)."""
        self.shared = shared
        if shared:
            self._transforms.share()
        return self

    # TorchRL's service API: a RemoteReplayBuffer is its own client, started at construction.
    service_backend = "direct"

    def client(self) -> RemoteReplayBuffer:
        return self

    def start(self) -> RemoteReplayBuffer:
        if not self.is_alive:
            raise RuntimeError("A shut down replay buffer cannot be restarted.")
        return self

    @property
    def is_alive(self) -> bool:
        return not self._shut_down

    def shutdown(self, timeout: float | None = None) -> None:
        """Close the connection; later calls raise ``RuntimeError`` (the table stays)."""
        self._shut_down = True
        self.replay_client.close()

    def __repr__(self) -> str:
        return (f"RemoteReplayBuffer({self.replay_client.address!r}, table={self.table!r}, "
                f"batch_size={self._batch_size})")


def _put(nested: dict[str, Any], key: Any, value: torch.Tensor) -> None:
    """Set the (nested) TensorDict ``key`` of the nested dict ``nested`` to ``value``."""
    *parents, leaf = key if isinstance(key, tuple) else (key,)
    for part in parents:
        nested = nested.setdefault(part, {})
    nested[leaf] = value

