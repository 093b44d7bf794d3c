"""The TOML config file, parsed into :class:`~replay_server.service.settings.ServerSettings`.

::

    [server]
    address = "127.0.0.1:50051"
    pin_memory = "auto"            # auto | true | false
    auth_token_env = "REPLAY_TOKEN"  # omitted: no auth
    max_message_mb = 4
    workers = 4                    # threads running engine work
    log_format = "text"            # text | json
    shared_memory = true           # offer same-host learners a /dev/shm ring
    checkpoint_dir = "checkpoints" # omitted: no persistence
    checkpoint_interval_s = 600    # 0: only on request and at shutdown
    keep_latest = 3                # complete checkpoints kept
    wal = false                    # write-ahead log: acknowledged changes survive a crash
    wal_sync = "fsync"             # fsync: survives power loss | os: a crash of the process
    wal_max_mb = 1024              # the log's bound (wal_dir: where it goes; checkpoint_dir)
    metrics_address = "127.0.0.1:9100"  # Prometheus /metrics; omitted: off
    tls_cert_file = "server.crt"   # TLS: certificate chain and key (PEM); omitted: plaintext
    tls_key_file = "server.key"
    tls_client_ca_file = "ca.crt"  # mutual TLS: clients need a certificate this CA signed
    allow_plaintext_token = false  # a token without TLS on a non-loopback address
    health_address = "0.0.0.0:50052"  # plaintext grpc.health.v1 only (for probes)

    [[tables]]
    name = "replay"
    capacity = 1_000_000
    sampler = "prioritized"        # uniform | prioritized | slice | prioritized_slice
    alpha = 0.6
    beta = 0.4
    min_size_to_sample = 1000      # rate limiter (optional; see replay_server.engine.rate_limiter)
    samples_per_insert = 8.0       # omitted: no ratio limit
    error_buffer = 8000.0          # omitted: a default from the two above
    max_times_sampled = 0          # 0: no limit
    [tables.schema]                # optional; else the first insert fixes it
    obs = "float32[17]"

The ``[[tables]]`` keys, their defaults and their checks are the table's and
its layers' own specs (:func:`~replay_server.engine.config.table_options`;
docs/service.md's reference is checked against them): a key of a sampler or
storage the table does not use is refused naming the one it belongs to.

Every problem is a :class:`~replay_server.errors.ConfigError` naming the
field and the value; an unknown key is refused, never silently ignored.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import fields
from difflib import get_close_matches
from pathlib import Path
from typing import Any

from replay_server.engine import FieldSpec, TableConfig, table_options
from replay_server.errors import ConfigError
from replay_server.service.settings import ServerSettings

log = logging.getLogger("replay_server")

_SPEC = re.compile(r"^([a-z0-9]+)\[([0-9, ]*)\]$")

# The keys a section accepts are the fields of what it configures: [[tables]] the keys
# the layers' specs declare (engine.config.table_options, read when a file is read, so a
# layer registered later is in it; the server sets each table's pin_memory from [server]).
_SERVER_KEYS = {f.name for f in fields(ServerSettings)} - {"tables"}


def load_settings(path: str | Path) -> ServerSettings:
    """Read and validate a TOML config file.

    Raises:
        ConfigError: the file cannot be read or parsed, or a value is invalid.
    """
    path = Path(path)
    text = _read_config(path)
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"config file {str(path)!r} nests arrays or tables too deeply to "
                          f"be a config") from None
    try:
        return settings_from_dict(document)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{path}: a value nests too deeply to be a config") from None


MAX_CONFIG_BYTES = 1 << 20
"""A config file larger than this is refused unread (a config is a few KB)."""


def _read_config(path: Path) -> str:
    """The file's text: a regular file of at most :data:`MAX_CONFIG_BYTES` of UTF-8. Opened
    without blocking, so a FIFO or a device is refused instead of waited on.

    Raises:
        ConfigError: the file cannot be opened (missing, unreadable, a symlink loop), is not
            a regular file, is too large, or is not UTF-8 text; the message names it.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "a socket" if stat.S_ISSOCK(mode) else "a device")
        raise ConfigError(f"config file {str(path)!r} is {kind}, not a regular file")
    with os.fdopen(fd, "rb") as file:
        data = file.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {str(path)!r} is over {MAX_CONFIG_BYTES >> 20} MiB: "
                          f"not a config")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (byte {exc.start} "
                          f"is {data[exc.start]:#04x})") from None


def settings_from_dict(document: Mapping[str, Any]) -> ServerSettings:
    """Validate an already-parsed config document."""
    unknown = set(document) - {"server", "tables"}
    if unknown:
        hints = "".join(_did_you_mean(name, {"server", "tables"}) for name in sorted(unknown))
        raise ConfigError(f"unknown top-level sections {sorted(unknown)}{hints}; expected "
                          f"[server] and [[tables]] (a key above every section belongs in "
                          f"[server])")
    if not isinstance(document.get("server", {}), Mapping):
        raise ConfigError(f"server must be a table ([server] with key = value lines), got "
                          f"{document['server']!r}")
    server = dict(document.get("server", {}))
    table_keys = set(table_options())
    _check_keys("server", server, _SERVER_KEYS, ("[[tables]]", table_keys))
    tables = document.get("tables")
    if tables is None:
        log.info("the config declares no [[tables]]: serving the default tables "
                 "(one per sampler kind)")
        return ServerSettings(**server)
    if not isinstance(tables, list):
        raise ConfigError("tables must be an array of tables ([[tables]])")
    configs, problems = [], []
    for index, table in enumerate(tables):
        try:
            configs.append(_table_config(index, table, table_keys))
        except ConfigError as exc:  # every table is checked: all their problems at once
            problems.append(str(exc))
    try:
        settings = ServerSettings(**server, tables=tuple(configs))
    except ConfigError as exc:
        problems.append(str(exc))
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{len(problems)} problems:\n  - " + "\n  - ".join(problems))
    return settings


def _table_config(index: int, table: Any, table_keys: set[str]) -> TableConfig:
    """The ``index``-th ``[[tables]]`` entry as a table config.

    Raises:
        ConfigError: its first problem, naming the table.
    """
    if not isinstance(table, Mapping):
        raise ConfigError(f"tables[{index}] must be a table ([[tables]] with key = value "
                          f"lines), got {table!r}")
    where = f"tables[{index}]" + (f" ({table.get('name')!r})" if "name" in table else "")
    _check_keys(where, table, table_keys, ("[server]", _SERVER_KEYS))
    options = dict(table)
    if "schema" in options:
        options["schema"] = _schema(where, options["schema"])
    if "name" not in options or "capacity" not in options:
        raise ConfigError(f"{where}: every table needs a name and a capacity")
    return TableConfig(**options)


def parse_field_spec(text: str) -> FieldSpec:
    """``"float32[84, 84, 4]"`` -> FieldSpec (``"int64[]"`` for one value per row)."""
    match = _SPEC.match(text.strip()) if isinstance(text, str) else None
    if not match:
        raise ValueError(f"expected 'dtype[dims]' like 'float32[17]' or 'int64[]', got {text!r}")
    dims = [d.strip() for d in match.group(2).split(",") if d.strip()]
    return FieldSpec(match.group(1), tuple(int(d) for d in dims))


def _schema(where: str, raw: Any) -> dict[str, FieldSpec]:
    if not isinstance(raw, Mapping) or not raw:
        raise ConfigError(f"{where}.schema must map column keys to 'dtype[dims]' strings")
    flat: dict[str, FieldSpec] = {}
    for key, value in _flatten_schema(raw):
        try:
            flat[key] = parse_field_spec(value)
        except ValueError as exc:
            raise ConfigError(f"{where}.schema.{key}: {exc}") from None
    return flat


def _flatten_schema(raw: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in raw.items():
        if isinstance(value, Mapping):
            yield from _flatten_schema(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _check_keys(where: str, section: Mapping[str, Any], allowed: set[str],
                elsewhere: tuple[str, set[str]]) -> None:
    """Refuse a key ``allowed`` lacks, naming a close one, or the section it belongs in."""
    for key in section:
        if key in allowed:
            continue
        other, other_keys = elsewhere
        hint = (f" (a key of {other}: TOML puts every key after a section's header in "
                f"that section)" if key in other_keys else _did_you_mean(key, allowed))
        raise ConfigError(f"{where}: unknown key {key!r}{hint}; allowed: {sorted(allowed)}")


def _did_you_mean(key: str, allowed: set[str]) -> str:
    """``"; did you mean 'x'?"`` when one allowed key is close to ``key``, else nothing."""
    close = get_close_matches(key.lower().replace("-", "_"), sorted(allowed), n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""
