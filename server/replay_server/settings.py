"""Server settings: the TOML config file, parsed into frozen, validated dataclasses.

::

    [server]
    address = "127.0.0.1:50051"
    pin_memory = "auto"            # auto | true | false
    auth_token_env = "REPLAY_TOKEN"  # omitted: no auth
    max_message_mb = 64
    workers = 4                    # threads running engine work
    log_format = "text"            # text | json
    shared_memory = true           # offer same-host learners a /dev/shm ring
    checkpoint_dir = "checkpoints" # omitted: no persistence
    checkpoint_interval_s = 600    # 0: only on request and at shutdown
    keep_latest = 3                # complete checkpoints kept

    [[tables]]
    name = "replay"
    capacity = 1_000_000
    sampler = "prioritized"        # uniform | prioritized | slice | prioritized_slice
    alpha = 0.6
    beta = 0.4
    min_size_to_sample = 1000      # rate limiter (optional; see replay_server.ratelimit)
    samples_per_insert = 8.0       # omitted: no ratio limit
    error_buffer = 8000.0          # omitted: a default from the two above
    max_times_sampled = 0          # 0: no limit
    [tables.schema]                # optional; else the first insert fixes it
    obs = "float32[17]"

Every problem is a :class:`~replay_server.errors.ConfigError` naming the
field and the value. Keys this version does not implement yet (metrics) are
refused, never silently ignored.
"""

from __future__ import annotations

import logging
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from replay_proto.dtypes import dtype_from_name
from replay_server.config import TableConfig, default_table_configs
from replay_server.errors import ConfigError
from replay_server.schema import FieldSpec

log = logging.getLogger("replay_server")

DEFAULT_ADDRESS = "127.0.0.1:50051"
_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.\-]+):(\d{1,5})$")
_SPEC = re.compile(r"^([a-z0-9]+)\[([0-9, ]*)\]$")

_SERVER_KEYS = {"address", "pin_memory", "auth_token_env", "max_message_mb", "workers",
                "log_format", "shared_memory", "checkpoint_dir", "checkpoint_interval_s",
                "keep_latest"}
_TABLE_KEYS = {"name", "capacity", "sampler", "alpha", "beta", "slice_len", "episode_key",
               "done_key", "truncated_key", "seed", "schema", "min_size_to_sample",
               "samples_per_insert", "error_buffer", "max_times_sampled"}
_NOT_YET = {
    "metrics_address": "metrics",
}


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    """How the server listens and runs.

    Attributes:
        address: ``host:port`` to listen on (port 0: any free port).
        pin_memory: ``"auto"`` pins table storage when a CUDA device is
            present; ``"true"`` without one is an error; ``"false"`` never pins.
        auth_token_env: environment variable holding the token clients must
            send (``authorization: Bearer <token>``); ``None``: no auth.
        max_message_mb: largest gRPC message either way, in MiB.
        workers: threads that run engine work off the event loop.
        log_format: ``"text"`` or ``"json"`` (one JSON object per line).
        shared_memory: offer learners on this host a shared-memory ring for
            ``SampleStream`` batches (they fall back to gRPC when they cannot map it).
        checkpoint_dir: where checkpoints are written and restored from
            (relative: to the working directory; created if missing);
            ``None``: no persistence.
        checkpoint_interval_s: seconds between timed checkpoints (counted
            from the end of the previous one); 0: only on request and at shutdown.
        keep_latest: complete checkpoints kept (older ones are removed).
        tables: the tables to serve.
    """

    address: str = DEFAULT_ADDRESS
    pin_memory: str = "auto"
    auth_token_env: str | None = None
    max_message_mb: int = 64
    workers: int = 4
    log_format: str = "text"
    shared_memory: bool = True
    checkpoint_dir: str | None = None
    checkpoint_interval_s: float = 600.0
    keep_latest: int = 3
    tables: tuple[TableConfig, ...] = field(default_factory=lambda: tuple(default_table_configs()))

    def __post_init__(self) -> None:
        if not isinstance(self.address, str) or not _ADDRESS.match(self.address) or not (
            0 <= int(self.address.rsplit(":", 1)[1]) <= 65535
        ):
            raise ConfigError(f"server.address must be 'host:port', got {self.address!r}")
        if self.pin_memory not in ("auto", "true", "false"):
            raise ConfigError(
                f"server.pin_memory must be 'auto', 'true' or 'false', got {self.pin_memory!r}"
            )
        if self.pin_memory == "true" and not torch.cuda.is_available():
            raise ConfigError(
                "server.pin_memory is 'true' but no CUDA device is available; use 'auto' to pin "
                "only where an accelerator is present, or 'false'"
            )
        if self.auth_token_env is not None and (
            not isinstance(self.auth_token_env, str) or not self.auth_token_env
        ):
            raise ConfigError(
                f"server.auth_token_env must name an environment variable, got "
                f"{self.auth_token_env!r}"
            )
        _check_int("server.max_message_mb", self.max_message_mb, 1, 2047)
        _check_int("server.workers", self.workers, 1, 256)
        if not isinstance(self.shared_memory, bool):
            raise ConfigError(f"server.shared_memory must be true or false, got {self.shared_memory!r}")
        if self.log_format not in ("text", "json"):
            raise ConfigError(f"server.log_format must be 'text' or 'json', got {self.log_format!r}")
        if self.checkpoint_dir is not None and (
            not isinstance(self.checkpoint_dir, str) or not self.checkpoint_dir
        ):
            raise ConfigError(
                f"server.checkpoint_dir must be a directory path, got {self.checkpoint_dir!r}")
        interval = self.checkpoint_interval_s
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not (
            0 <= interval < float("inf")
        ):
            raise ConfigError(
                f"server.checkpoint_interval_s must be a number of seconds >= 0 (0: only on "
                f"request and at shutdown), got {interval!r}")
        _check_int("server.keep_latest", self.keep_latest, 1, 1_000_000)
        names = [t.name for t in self.tables]
        if not names:
            raise ConfigError("the config declares no [[tables]]")
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ConfigError(f"table names must be unique; repeated: {duplicates}")

    @property
    def pinned(self) -> bool:
        """Whether table storage is pinned, ``pin_memory`` resolved."""
        return self.pin_memory == "true" or (
            self.pin_memory == "auto" and torch.cuda.is_available()
        )

    @property
    def max_message_bytes(self) -> int:
        return self.max_message_mb * 1024 * 1024


def load_settings(path: str | Path) -> ServerSettings:
    """Read and validate a TOML config file.

    Raises:
        ConfigError: the file cannot be read or parsed, or a value is invalid.
    """
    path = Path(path)
    try:
        document = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
    try:
        return settings_from_dict(document)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def settings_from_dict(document: Mapping[str, Any]) -> ServerSettings:
    """Validate an already-parsed config document."""
    unknown = set(document) - {"server", "tables"}
    if unknown:
        raise ConfigError(f"unknown top-level sections {sorted(unknown)}; expected [server] "
                          f"and [[tables]]")
    server = dict(document.get("server", {}))
    _check_keys("server", server, _SERVER_KEYS)
    tables = document.get("tables")
    if tables is None:
        log.info("the config declares no [[tables]]: serving the default tables "
                 "(one per sampler kind)")
        return ServerSettings(**server)
    if not isinstance(tables, list):
        raise ConfigError("tables must be an array of tables ([[tables]])")
    configs = []
    for index, table in enumerate(tables):
        where = f"tables[{index}]" + (f" ({table.get('name')!r})" if "name" in table else "")
        _check_keys(where, table, _TABLE_KEYS)
        options = dict(table)
        if "schema" in options:
            options["schema"] = _schema(where, options["schema"])
        if "name" not in options or "capacity" not in options:
            raise ConfigError(f"{where}: every table needs a name and a capacity")
        configs.append(TableConfig(**options))
    return ServerSettings(**server, tables=tuple(configs))


def parse_field_spec(text: str) -> FieldSpec:
    """``"float32[84, 84, 4]"`` -> FieldSpec (``"int64[]"`` for one value per row)."""
    match = _SPEC.match(text.strip()) if isinstance(text, str) else None
    if not match:
        raise ValueError(f"expected 'dtype[dims]' like 'float32[17]' or 'int64[]', got {text!r}")
    dims = [d.strip() for d in match.group(2).split(",") if d.strip()]
    return FieldSpec(dtype_from_name(match.group(1)), tuple(int(d) for d in dims))


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


def _flatten_schema(raw: Mapping[str, Any], prefix: str = ""):
    for key, value in raw.items():
        if isinstance(value, Mapping):
            yield from _flatten_schema(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _check_keys(where: str, section: Mapping[str, Any], allowed: set[str]) -> None:
    for key in section:
        if key in _NOT_YET:
            raise ConfigError(
                f"{where}.{key} is not supported by this version yet ({_NOT_YET[key]} are not "
                f"built); remove it"
            )
        if key not in allowed:
            raise ConfigError(f"{where}: unknown key {key!r}; allowed: {sorted(allowed)}")


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
