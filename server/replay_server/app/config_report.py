"""``replay-server check-config``: what a valid config file will serve, checked without serving.

Beyond what reading the file checks (every key and value,
:mod:`replay_server.app.config_file`), it promises each table's memory at
its capacity as the server would at start (sampler state, plus the rows of a
declared schema) against ``server.table_memory_mb`` or this machine's
memory, and says what ``checkpoint_dir`` holds: the newest checkpoint there
is what the server restores, and it must fit this config. Nothing is
allocated, bound or written.
"""

from __future__ import annotations

from replay_server.checkpoint.directory import CheckpointDirectory
from replay_server.checkpoint.wal.sync_modes import SYNC_PROMISES
from replay_server.engine import (
    MemoryLedger,
    Schema,
    TableConfig,
    format_bytes,
    layer_names,
    table_bytes,
    table_options,
)
from replay_server.errors import ConfigError, InsufficientMemoryError
from replay_server.service.limits import MIB
from replay_server.service.settings import ServerSettings


def config_report(settings: ServerSettings) -> str:
    """Lines an operator reads: address, persistence, memory and every table.

    Raises:
        ConfigError: the tables at their capacity need more memory than the
            server may give them (the server would refuse to start).
    """
    mb = settings.table_memory_mb
    ledger = MemoryLedger(mb * MIB, "server.table_memory_mb") if mb else MemoryLedger()
    # Pinning promises no byte more. "true" is resolved here as serve resolves it (a table
    # that cannot be pinned is refused); "auto" at start, where it asks the accelerator
    # (torch), and it never refuses a table.
    tables = settings.table_configs if settings.pin_memory == "true" else settings.tables
    for table in tables:
        declared = None if table.schema is None else Schema(table.schema)
        try:
            ledger.require(table.name, table_bytes(table, declared),
                           f"capacity {table.capacity:,}")
        except InsufficientMemoryError as exc:
            raise ConfigError(str(exc)) from None
    lines = [f"listens on {settings.address}"
             + (f", metrics on {settings.metrics_address}" if settings.metrics_address else ""),
             _persistence(settings),
             _log(settings),
             f"tables promise {format_bytes(ledger.committed)} at start (of "
             f"{format_bytes(ledger.limit)} allowed; rows of an undeclared schema come with "
             f"the first insert)",
             layers_report(),
             f"{len(settings.tables)} table(s):"]
    lines += [f"  {_table(table)}" for table in settings.tables]
    return "\n".join(lines)


def _persistence(settings: ServerSettings) -> str:
    if settings.checkpoint_dir is None:
        return "no checkpoint_dir: every row is lost when the server stops"
    directory = CheckpointDirectory(settings.checkpoint_dir)  # only read: not opened, not locked
    found = directory.complete()
    text = f"checkpoints in {directory.path}"
    if not found:
        return f"{text}: none yet (the server starts with empty tables)"
    return (f"{text}: {len(found)}; the newest, {found[-1].path.name}, is restored at start "
            f"and must fit these tables (a different config: another checkpoint_dir)")


def _log(settings: ServerSettings) -> str:
    if not settings.wal:
        return ("write-ahead log off (wal = false): after a crash the tables come back as the "
                "last checkpoint had them")
    return (f"write-ahead log in {settings.wal_dir or settings.checkpoint_dir}, wal_sync = "
            f"{settings.wal_sync}: {SYNC_PROMISES[settings.wal_sync]}; at most "
            f"{settings.wal_max_mb} MB (server.wal_max_mb)")


def _table(table: TableConfig) -> str:
    """``name: sampler, capacity N`` and every option set away from its default, as each
    layer's spec declares it (:func:`~replay_server.engine.config.table_options`)."""
    options = table_options()
    set_ = [f"{key}={value}" for key, value in table.describe().items()
            if key not in ("name", "capacity", "sampler")
            and value != _plain_default(options[key][0][1].default)]
    if table.schema is not None:
        set_.append(f"schema {Schema(table.schema).describe()}")
    return (f"{table.name}: {table.sampler.value}, capacity {table.capacity:,}"
            + "".join(f", {extra}" for extra in set_))


def _plain_default(default: object) -> object:
    return list(default) if isinstance(default, tuple) else default


def layers_report() -> str:
    """The samplers and storage backends this server knows (its registries)."""
    return "; ".join(f"{layer}: {names}" for layer, names in layer_names().items())
