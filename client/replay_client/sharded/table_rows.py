"""Rows by position and sampling settings on a sharded client (``read``, ``write``, ``set_sampling``).

``set_sampling`` (alpha, beta, seed) goes to every shard: the logical table
draws with the same settings on each. ``read`` by ids asks each id's shard;
``read`` by position reads the logical table's positions, the shards' rings
laid end to end in shard order (:mod:`replay_client.id_positions`: what a
``RemoteReplayBuffer``'s ``"index"`` holds over shards, so ``rb[index]``
works), one ``info`` round to learn the shards' capacities. ``write`` by
position is refused, naming the way (one shard's own ``ReplayClient``): a
write is not atomic across shards. :class:`ShardedTableRows` gives
:class:`~replay_client.sharded.client.ShardedClient` these calls as its own.

Thread-safety: as the sharded client.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from replay_client.arguments import id_array
from replay_client.errors import InvalidArgumentError, UnsupportedError
from replay_client.sharded.routing import by_owner
from replay_client.table_rows import RowsRead


def _refusal(what: str, table: str) -> UnsupportedError:
    return UnsupportedError(
        f"{what} rows of table {table!r} by position goes to one shard (a write is not "
        f"atomic across shards): use that shard's ReplayClient(address) "
        f"(client.shards maps shard index -> address)")


class ShardedTableRows:
    """``set_sampling``, ``read`` and ``write`` of the sharded client (a base class of
    :class:`~replay_client.sharded.client.ShardedClient`; see the module docstring).
    ``_all``, ``_each`` and ``_connect`` are the client's."""

    def _all(self, call: Callable[[Any], Any], tolerate: bool = False) -> dict[int, Any]:
        raise NotImplementedError  # the sharded client's: one call on every shard

    def _each(self, calls: Mapping[int, Callable[[Any], Any]],
              tolerate: bool = False) -> dict[int, Any]:
        raise NotImplementedError  # the sharded client's: each shard's own call

    def _connect(self) -> dict[int, Any]:
        raise NotImplementedError  # the sharded client's: its clients by shard index

    def set_sampling(self, table: str, **settings: Any) -> tuple[float, float]:
        """Set how ``table`` draws on every shard (see ``ReplayClient.set_sampling``)."""
        answers = self._all(lambda client: client.set_sampling(table, **settings))
        return next(iter(answers.values()))

    def read(self, table: str, **request: Any) -> RowsRead:
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
        parts = self._each({s: _reading(table, {**request, **kw}) for s, kw in asked.items()})
        return _gathered(parts, groups, values.size)

    def write(self, table: str, positions: Any, data: Any) -> int:
        """Refused: writing rows by position is not atomic across shards (see the module
        docstring)."""
        raise _refusal("writing", table)


def _reading(table: str, request: dict[str, Any]) -> Callable[[Any], RowsRead]:
    return lambda client: client.read(table, **request)


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
