"""Real server processes for the swapped buffers, one per table configuration.

A TorchRL test builds buffers of many shapes (capacities, samplers, slice
lengths); a server's tables are fixed by its config file. So the pool starts
one ``replay-server serve`` process per distinct table configuration, with
``TABLES_PER_SERVER`` identical tables, and hands each buffer a table of its
own: a fresh table (or, once the tables run out, a table reset with its
schema) so no test sees another's rows, schema or counters. At most
``MAX_SERVERS`` processes run at once; the least recently used is stopped
between tests.

Runs inside the pytest process of the TorchRL virtualenv; the servers run
with the repository's own interpreter (``server_python``), which has the
server's dependencies. Everything binds 127.0.0.1, port 0.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SERVER_PATH = [ROOT / "proto", ROOT / "feed", ROOT / "server"]
"""The server runs from this checkout's source (whatever the interpreter has installed)."""

START_TIMEOUT_S = 60.0
TABLES_PER_SERVER = 16
MAX_SERVERS = 6


@dataclass
class _Server:
    process: subprocess.Popen
    address: str
    tables: list[str]
    handed_out: int = 0
    log: Path = field(default_factory=Path)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def config_text(table: dict[str, Any], names: list[str]) -> str:
    """A server config holding ``names``, each a table of ``table``'s settings."""
    lines = []
    for name in names:
        lines.append("[[tables]]")
        lines.append(f"name = {_toml_value(name)}")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in sorted(table.items()))
        lines.append("")
    return "\n".join(lines)


class ServerPool:
    """Tables on demand, each on a server started for its configuration.

    Args:
        python: the interpreter that runs ``replay_server`` (the repository's venv).
        workdir: where config files, port files and server logs go.
        tables_per_server: identical tables per server process.
        max_servers: processes kept running at once.
    """

    def __init__(self, python: str, workdir: Path, *, tables_per_server: int = TABLES_PER_SERVER,
                 max_servers: int = MAX_SERVERS) -> None:
        self._python = python
        self._workdir = workdir
        self._per_server = tables_per_server
        self._max = max_servers
        self._servers: OrderedDict[tuple, _Server] = OrderedDict()
        self._serial = itertools.count()
        self.started = 0

    def table(self, config: dict[str, Any], reset: Any = None) -> tuple[str, str]:
        """``(address, table name)`` of a table of ``config`` that no buffer used before.

        ``reset(address, table)``: forgets a used table's rows and schema, so
        tables can be handed out again once every table of a server was used
        (``None``: a new server is started instead).
        """
        key = tuple(sorted((k, repr(v)) for k, v in config.items()))
        server = self._servers.get(key)
        if server is not None and server.process.poll() is not None:
            self._servers.pop(key)
            server = None
        if server is not None and server.handed_out >= len(server.tables) and reset is None:
            self._stop(self._servers.pop(key))
            server = None
        if server is None:
            server = self._start(config)
            self._servers[key] = server
        self._servers.move_to_end(key)
        name = server.tables[server.handed_out % len(server.tables)]
        if server.handed_out >= len(server.tables):
            reset(server.address, name)
        server.handed_out += 1
        return server.address, name

    def trim(self) -> None:
        """Stop the least recently used servers beyond ``max_servers`` (between tests)."""
        while len(self._servers) > self._max:
            _, server = self._servers.popitem(last=False)
            self._stop(server)

    def close(self) -> None:
        while self._servers:
            self._stop(self._servers.popitem()[1])

    def _start(self, config: dict[str, Any]) -> _Server:
        serial = next(self._serial)
        names = [f"t{i}" for i in range(self._per_server)]
        config_path = self._workdir / f"server{serial}.toml"
        config_path.write_text(config_text(config, names))
        port_file = self._workdir / f"server{serial}.port"
        port_file.unlink(missing_ok=True)  # an earlier run's, into the same --out: not this one's
        log = self._workdir / f"server{serial}.log"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in SERVER_PATH)}
        with log.open("w") as out:
            process = subprocess.Popen(
                [self._python, "-m", "replay_server.app.cli", "serve", "--config",
                 str(config_path), "--address", "127.0.0.1:0", "--port-file", str(port_file),
                 "--grace", "1"],
                stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if port_file.exists() and port_file.read_text().strip():
                self.started += 1
                return _Server(process, f"127.0.0.1:{int(port_file.read_text())}", names, log=log)
            if process.poll() is not None:
                raise RuntimeError(f"replay server for {config} exited with "
                                   f"{process.returncode}:\n{log.read_text()[-3000:]}")
            time.sleep(0.02)
        process.kill()
        raise RuntimeError(f"replay server for {config} did not start in {START_TIMEOUT_S} s")

    @staticmethod
    def _stop(server: _Server) -> None:
        if server.process.poll() is None:
            server.process.terminate()
        try:
            server.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()
