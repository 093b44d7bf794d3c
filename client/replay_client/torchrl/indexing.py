"""``rb[index]``, ``rb[index] = data``, ``set_``, ``set_at_``, ``update_`` and ``rb.storage``.

TorchRL's buffers read and write rows by storage position; a server does it
through ``ReplayClient.read`` and ``ReplayClient.write`` (positions: 0, 1, 2,
... in insertion order from the table's creation or last reset, wrapping at
capacity, as TorchRL's storages). An index may also hold the ids a sample
returned (:mod:`~replay_client.torchrl.positions`). Reads come back as the
kind of data the buffer was given, through its transforms, as TorchRL's
``rb[index]`` does. Writes replace whole rows in place: a column set with
``set_`` / ``set_at_`` / ``update_`` is read, changed and written back with
the rest of its rows. A written row keeps its id and, in a prioritized
table, gets the priority of a new row (TorchRL's ``mark_update``). Tables
whose rows are linked (slices, n-step, frame stacks, queues) refuse writes,
naming why.

These functions are :class:`~replay_client.torchrl.buffer.RemoteReplayBuffer`'s
methods; they take the buffer first.

Thread-safety: as the client; a read-modify-write is not atomic against
other writers of the same rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from replay_client.errors import InvalidArgumentError
from replay_client.torchrl.positions import ID_KEY, as_index_array, split_index
from replay_proto.keys import unflatten
from replay_proto.rows import rows_of

_METADATA = ("index", ID_KEY, "_weight", "priority_weight")


def _is_scalar(index: Any) -> bool:
    return isinstance(index, (int, np.integer)) or (
        isinstance(index, torch.Tensor) and index.dim() == 0)


def read_rows(buffer: Any, index: Any) -> TensorDictBase:
    """The rows ``index`` names, as a TensorDict ``[n]`` of the stored columns."""
    size = len(buffer)
    values = as_index_array(index, size)
    kind = split_index(values)
    got = buffer.replay_client.read(buffer.table, **{kind: values})
    episodes = buffer._episodes
    columns = got.columns if episodes is None else episodes.strip(got.columns)
    return buffer._rows.restore(TensorDict(unflatten(columns), batch_size=[values.size]))


def _is_key(index: Any) -> bool:
    return isinstance(index, str) or (isinstance(index, tuple) and bool(index)
                                      and all(isinstance(k, str) for k in index))


def get_rows(buffer: Any, index: Any) -> Any:
    """``rb[index]``: rows by storage position (int, slice, sequence, mask) or by id;
    ``rb["key"]``: that column of every stored row."""
    if _is_key(index):
        return buffer._transforms.forward(read_rows(buffer, slice(None))).get(index)
    td = buffer._transforms.forward(read_rows(buffer, index))
    if _is_scalar(index):
        td = td[0]
    return buffer._kind.decode(td)


def set_rows(buffer: Any, index: Any, value: Any) -> None:
    """``rb[index] = value``: overwrite the rows at those storage positions."""
    scalar = _is_scalar(index)
    values = as_index_array(index, len(buffer))
    if split_index(values) == "ids":
        raise InvalidArgumentError("rb[index] = data takes storage positions, not ids")
    td = buffer._kind.encode(value, single=scalar)
    if scalar:
        td = td.unsqueeze(0)
    elif td.batch_dims == 0:
        td = td.unsqueeze(0).expand(values.size)
    _write(buffer, values, td)


def _write(buffer: Any, positions: np.ndarray, td: TensorDictBase) -> None:
    rows = td.exclude(*_METADATA).contiguous().copy()
    rows.batch_size = rows.batch_size[:1]  # a row's own batch dims are part of it
    buffer.replay_client.write(buffer.table, positions, rows_of(rows))


def read_all_in_order(buffer: Any, end: int | None = None) -> Any:
    """``rb.read_all_in_order(end)``: the stored rows in position order (``rb[:end]``)."""
    return get_rows(buffer, slice(None, end))


def write_all(buffer: Any, data: Any, end: int | None = None) -> None:
    """``rb.write_all(data, end)``: ``rb[:end] = data`` (``end``: ``data``'s length)."""
    if end is None:
        end = data.shape[0] if hasattr(data, "shape") else len(data)
    set_rows(buffer, slice(None, end), data)


def set_column(buffer: Any, key: Any, value: Any) -> None:
    """``rb.set_(key, value)``: set column ``key`` of every stored row (in position order)."""
    positions = np.arange(len(buffer), dtype=np.int64)
    td = read_rows(buffer, positions)
    td.set(key, torch.as_tensor(value).expand(td.get(key).shape).to(td.get(key).dtype))
    _write(buffer, positions, td)


def set_column_at(buffer: Any, key: Any, value: Any, index: Any) -> None:
    """``rb.set_at_(key, value, index)``: set column ``key`` of the rows at ``index``."""
    positions = as_index_array(index, len(buffer))
    td = read_rows(buffer, positions)
    column = td.get(key)
    td.set(key, torch.as_tensor(value).to(column.dtype).expand(column.shape))
    _write(buffer, positions, td)


def update_columns(buffer: Any, data: Any, clone: bool = False, *,
                   keys_to_update: Any = None) -> None:
    """``rb.update_(data)``: update every stored row's columns from ``data`` (``[len(rb)]``)."""
    positions = np.arange(len(buffer), dtype=np.int64)
    td = read_rows(buffer, positions)
    source = buffer._kind.encode(data)
    if keys_to_update is not None:
        source = source.select(*keys_to_update)
    td.update(source.exclude(*_METADATA), clone=clone)
    _write(buffer, positions, td)


def query(buffer: Any, predicate: Any = None, *, trajectory_key: Any = None) -> list[Any]:
    """``rb.query(predicate)``: the stored trajectories that match, oldest first, as
    TorchRL's ``filter_trajectories`` finds them in the rows (read oldest first, through the
    buffer's transforms). Needs torchrl (its trajectory predicates)."""
    from torchrl.data.replay_buffers.query import filter_trajectories

    size = len(buffer)
    if not size:
        return []
    positions = np.arange(size, dtype=np.int64)
    ids = buffer.replay_client.read(buffer.table, positions=positions, columns=False).ids
    rows = read_rows(buffer, positions[np.argsort(ids.numpy(), kind="stable")])
    return filter_trajectories(buffer._transforms.forward(rows), predicate,
                               trajectory_key=trajectory_key)


def reset(buffer: Any) -> None:
    """Remove every row of the buffer's table and forget its schema."""
    try:
        buffer.replay_client.reset(buffer.table, schema=True)
    except TypeError:  # a client without schema resets (before replay-server 0.2)
        buffer.replay_client.reset(buffer.table)


class RemoteStorage:
    """``rb.storage``: the table's rows by storage position, as TorchRL's storage API reads them.

    ``len(storage)``, ``storage.max_size``, ``storage[index]`` / ``storage.get(index)``.
    """

    def __init__(self, buffer: Any) -> None:
        self._buffer = buffer

    def __len__(self) -> int:
        return len(self._buffer)

    @property
    def max_size(self) -> int:
        return self._buffer.table_info().capacity

    def get(self, index: Any) -> Any:
        td = read_rows(self._buffer, index)
        if _is_scalar(index):
            td = td[0]
        return self._buffer._kind.decode(td)

    __getitem__ = get

    def __repr__(self) -> str:
        return f"RemoteStorage(table={self._buffer.table!r}, max_size={self.max_size})"
