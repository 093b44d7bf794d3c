"""The set of named tables a server holds."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from replay_server.engine.config import TableConfig
from replay_server.engine.incarnations import IncarnationSource
from replay_server.engine.memory import MemoryLedger
from replay_server.errors import ConfigError, UnknownTableError
from replay_server.engine.table import Table


class TableSet:
    """Named tables, fixed at construction.

    Args:
        configs: one per table.
        incarnations: the server's shard and id incarnations (``None``: in-process).
        memory: the ledger all tables' memory is promised from (``None``: a new
            one over this machine's memory).
        make_table: what makes each table (a :class:`Table` subclass: a server's log its
            changes, :mod:`replay_server.checkpoint.wal.logged_table`).

    Raises:
        ConfigError: names repeat, no table is given, or a table cannot be made
            (see :class:`~replay_server.engine.table.Table`).

    Thread-safety: the set never changes after construction, so lookups need no
    lock; each :class:`~replay_server.engine.table.Table` guards itself.
    """

    def __init__(self, configs: Iterable[TableConfig],
                 incarnations: IncarnationSource | None = None,
                 memory: MemoryLedger | None = None,
                 make_table: Callable[..., Table] = Table) -> None:
        self._tables: dict[str, Table] = {}
        self.memory = memory or MemoryLedger()
        for config in configs:
            if config.name in self._tables:
                raise ConfigError(f"two tables are named {config.name!r}; table names must be unique")
            self._tables[config.name] = make_table(config, incarnations, self.memory)
        if not self._tables:
            raise ConfigError("a server needs at least one table")

    def __getitem__(self, name: str) -> Table:
        try:
            return self._tables[name]
        except KeyError:
            raise UnknownTableError(
                f"no table named {name!r}; tables: {', '.join(sorted(self._tables))}"
            ) from None

    def __iter__(self) -> Iterator[Table]:
        return iter(self._tables.values())

    def __len__(self) -> int:
        return len(self._tables)

    @property
    def names(self) -> list[str]:
        return list(self._tables)
