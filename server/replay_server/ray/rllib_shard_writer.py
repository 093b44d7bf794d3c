"""An env runner's writes to the replay's shards: one client, ordered background inserts per table.

What :class:`~replay_server.ray.rllib_env_runner.ShardedEnvRunner` and
:class:`~replay_server.ray.rllib_multi_env_runner.ShardedMultiAgentEnvRunner`
share: where to write (read from ``replay_buffer_config``: ``replay`` and
``namespace``, or ``address``; ``client_options``; ``pending_adds``), a client
opened at the first write (the driver's buffer makes the replay first), one
:class:`~replay_server.ray.pending_adds.PendingAdds` per table written, and
the first failed insert, which the env runner hands the driver as a
:class:`~replay_server.ray.rllib_written.WriteFailure`.

Cost: one client and one writer thread per table written. Thread-safety: one
caller (the env runner) at a time.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping
from typing import Any

import replay_client
from replay_client import ReplayClient
from replay_server.ray.cluster import DEFAULT_NAMESPACE, RESOLVE_INTERVAL_S
from replay_server.ray.pending_adds import PendingAdds
from replay_server.ray.rllib_written import WriteFailure

logger = logging.getLogger(__name__)
WriterError = replay_client.errors.WriterError  # through the client's front door


class ShardWriter:
    """An env runner's inserts into the replay named by ``settings`` (see the module docstring).

    Args:
        settings: the algorithm's ``replay_buffer_config``.
        source: what the errors name as sending the rows (``"env runner 2's sample"``).
    """

    def __init__(self, settings: Mapping[str, Any], source: str) -> None:
        self.address = settings.get("address") or (
            f"ray://{settings.get('namespace', DEFAULT_NAMESPACE)}/"
            f"{settings.get('replay', 'rllib')}")
        self._client_options = dict(settings.get("client_options") or {})
        self._most = int(settings.get("pending_adds", 4))
        self._source = source
        self._client: Any = None  # made at the first write: the buffer makes the replay
        self._writes: dict[str, PendingAdds] = {}

    def put(self, table: str, rows: dict[str, Any], count: int) -> None:
        """Queue the insert of ``rows`` (``count`` of them) into ``table`` (the shards give
        them the largest priority seen); with ``pending_adds`` 0, wait until it is stored.

        Raises:
            WriterError: an earlier insert into ``table`` failed.
        """
        if self._client is None:
            options = {"resolve_interval_s": RESOLVE_INTERVAL_S, **self._client_options}
            self._client = ReplayClient(self.address, **options)
        writes = self._writes.get(table)
        if writes is None:
            writes = self._writes[table] = PendingAdds(self._client, table,
                                                       max(1, self._most), source=self._source)
        writes.put(rows, None, count)
        if self._most == 0:
            writes.wait()

    def failure(self, wait: bool = False) -> WriteFailure | None:
        """The first failed insert, as a :class:`WriteFailure` (``wait``: once every insert
        on its way is done), or ``None``."""
        try:
            for writes in self._writes.values():
                writes.wait() if wait else writes.check()
        except WriterError as exc:
            return WriteFailure(str(exc))
        return None

    def close(self, timeout: float = 30.0) -> None:
        """Store the inserts on their way (up to ``timeout`` s each; a failure is logged,
        naming the rows), end the writer threads and close the client."""
        for writes in self._writes.values():
            try:
                writes.wait(timeout=timeout)
            except WriterError as exc:
                logger.error("%s", exc)
            writes.stop()
        if self._client is not None:
            self._client.close()


def configured_class(kind: Any) -> Any:
    """The class ``replay_buffer_config["type"]`` names (a class, or its dotted path), or
    ``None`` where it names none that imports."""
    if isinstance(kind, str) and "." in kind:
        module, _, name = kind.rpartition(".")
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            return None
    return kind if isinstance(kind, type) else None
