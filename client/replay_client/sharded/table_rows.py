"""Rows by position and sampling settings on a sharded client (``read``, ``write``, ``set_sampling``).

``set_sampling`` (alpha, beta, seed) goes to every shard: the logical table
draws with the same settings on each. ``read`` by ids asks each id's shard;
``read`` by position reads the logical table's positions, the shards' rings
laid end to end in shard order (:mod:`replay_client.id_positions`: what a
``RemoteReplayBuffer``'s ``"index"`` holds over shards, so ``rb[index]``
works), one ``info`` round to learn the shards' capacities. ``write`` by
position is refused, naming the way (one shard's own ``ReplayClient``): a
write is not atomic across shards. :func:`with_table_rows` gives
:class:`~replay_client.sharded.client.ShardedClient` these calls as its own.

Thread-safety: as the sharded client.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from replay_client.arguments import id_array
from replay_client.errors import InvalidArgumentError, UnsupportedError
from replay_client.sharded.routing import by_owner
from replay_client.table_rows import RowsRead


def _set_sampling(self: Any, table: str, **settings: Any) -> tuple[float, float]:
    """Set how ``table`` draws on every shard (see ``ReplayClient.set_sampling``)."""
    answers = self._all(lambda client: client.set_sampling(table, **settings))
    return next(iter(answers.values()))


def _refusal(what: str, table: str) -> UnsupportedError:
    return UnsupportedError(
        f"{what} rows of table {table!r} by storage position is per shard (each server "
        f"has its own positions): use that shard's ReplayClient(address) "
        f"(client.shards maps shard index -> address)")


def _read(self: Any, table: str, **request: Any) -> RowsRead:
    """The stored rows named by ``ids=`` or at the logical table's ``positions=`` (see the
    module docstring), in the order given, each shard asked at once; ``columns=`` and
    ``priorities=`` as ``ReplayClient.read``.

    Raises:
        InvalidArgumentError: neither or both of ``positions`` and ``ids``, or a position
            outside ``0 .. summed capacity - 1``. InvalidIdsError, ... as ``ReplayClient.read``.
    """
    positions, ids = request.pop("positions", None), request.pop("ids", None)
    if (positions is None) == (ids is None):
        raise InvalidArgumentError("read() takes positions=... or ids=..., exactly one")
    if ids is not None:
        values = id_array(ids).reshape(-1)
        groups = by_owner(values, self._connect(), "nothing was read")
        asked = {s: {"ids": values[rows]} for s, rows in groups.items()}
    else:
        values = torch.as_tensor(positions).to(torch.int64).numpy().reshape(-1)
        infos = self._all(lambda c: c.info()[table].capacity, tolerate=True)
        shards = sorted(infos)
        ends = np.cumsum([infos[s] for s in shards])
        outside = (values < 0) | (values >= ends[-1])
        if outside.any():
            raise InvalidArgumentError(
                f"table {table!r}: position {int(values[outside][0])} is outside "
                f"0..{int(ends[-1]) - 1} (the shards' positions end to end)")
        owner = np.searchsorted(ends, values, side="right")
        groups = {shards[k]: np.flatnonzero(owner == k) for k in np.unique(owner).tolist()}
        starts = dict(zip(shards, ends - [infos[s] for s in shards]))
        asked = {s: {"positions": values[rows] - starts[s]} for s, rows in groups.items()}
    if not asked:  # no rows asked for: one shard's empty answer has the columns' shapes
        shard = min(self._connect())
        asked, groups = {shard: {"ids" if ids is not None else "positions": values}}, {
            shard: values}
    parts = self._each({s: (lambda c, kw=kw: c.read(table, **request, **kw))
                        for s, kw in asked.items()})
    return _gathered(parts, groups, values.size)


def _gathered(parts: dict[int, RowsRead], groups: dict[int, np.ndarray], n: int) -> RowsRead:
    """One read of ``n`` rows from each shard's part, the rows back in the order asked
    (``size``: the rows the shards asked held)."""
    first = next(iter(parts.values()))

    def gather(pick: Any) -> torch.Tensor:
        like = pick(first)
        out = torch.empty((n, *like.shape[1:]), dtype=like.dtype)
        for shard, part in parts.items():
            out[torch.from_numpy(groups[shard])] = pick(part)
        return out

    columns = {key: gather(lambda part, key=key: part.columns[key]) for key in first.columns}
    return RowsRead(columns, gather(lambda part: torch.as_tensor(part.ids)),
                    None if first.priorities is None else gather(
                        lambda part: torch.as_tensor(part.priorities)),
                    sum(part.size for part in parts.values()))


def _write(self: Any, table: str, positions: Any, data: Any) -> int:
    """Refused: writing rows by position is per shard (see the module docstring)."""
    raise _refusal("writing", table)


def with_table_rows(cls: type) -> type:
    """Class decorator: ``cls`` (the sharded client) gets ``set_sampling``, ``read`` and ``write``."""
    cls.set_sampling = _set_sampling
    cls.read = _read
    cls.write = _write
    return cls
