"""``BufferTable``: one prioritized table of a replay as an RLlib episode buffer uses it.

An RLlib buffer of :mod:`replay_server.ray` keeps its rows in one table per
module (the single-agent buffer: one table): :class:`BufferTable` is what the
buffer does with each table.

**Adds wait for no round trip** (``pending_adds``, default 4): each insert
goes to the shards from a background thread, in order, while the algorithm
samples and trains (:mod:`~replay_server.ray.pending_adds`); a failed one is
raised by the next add (or :meth:`BufferTable.flush`) as ``WriterError``.
``pending_adds=0`` waits for each insert.

**Samples come from a stream** (``prefetch``, default 2): the first
:meth:`BufferTable.draw` opens a learner stream of that batch size over every
shard (merged exactly, as ``client.stream``), which draws up to ``prefetch``
batches ahead while the algorithm trains; a draw takes the next one, and
:meth:`BufferTable.update` rides on the stream's next credit. So a training
step waits on no sample and no update round trip. What that costs, as with
Reverb's datasets: a batch may have been drawn before the last ``prefetch``
updates were applied. ``prefetch=0`` draws each sample by a call and waits for
each update (RLlib's own order, one round trip each). Another batch size or
``beta`` reopens the stream; :meth:`BufferTable.flush` stores the adds and
applies the updates still on their way.

Thread-safety: one caller at a time (the algorithm's training step); the
client is shared with the background adds (clients are thread-safe).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from replay_client import ReplayClient
from replay_proto.scalars import is_int
from replay_server.errors import ConfigError
from replay_server.ray.cluster import ReplayCluster
from replay_server.ray.pending_adds import PendingAdds


def check_options(*, batch_length_T: int, n_step: Any, prefetch: Any,
                  pending_adds: Any) -> None:
    """Refuse, by name, the buffer options the RLlib buffers cannot honour.

    Raises:
        ConfigError: the option, the bad value and what it must be.
    """
    if batch_length_T not in (0, 1):
        raise ConfigError(f"the sharded RLlib buffers sample rows: batch_length_T must be 1, "
                          f"got {batch_length_T!r}")
    if not is_int(n_step) or n_step < 1:
        raise ConfigError(f"n_step must be an int >= 1 (the table's n-step return), got "
                          f"{n_step!r}")
    if not is_int(prefetch) or prefetch < 0:
        raise ConfigError(f"prefetch must be an int >= 0 (batches drawn ahead; 0: a call "
                          f"per sample), got {prefetch!r}")
    if not is_int(pending_adds) or pending_adds < 0:
        raise ConfigError(f"pending_adds must be an int >= 0 (inserts on their way; 0: "
                          f"each add waits), got {pending_adds!r}")


def table_entry(name: str, *, capacity: int, num_shards: int, alpha: float, beta: float,
                n_step: int, gamma: float) -> dict[str, Any]:
    """The ``[[tables]]`` entry of a buffer's table: ``capacity`` rows over ``num_shards``."""
    per_shard = -(-int(capacity) // max(1, int(num_shards)))
    return {"name": name, "capacity": per_shard, "sampler": "prioritized", "alpha": alpha,
            "beta": beta, "n_step": n_step, "gamma": gamma}


def check_sample_args(*, n_step_stored: int, gamma_stored: float, batch_length_T: Any,
                      n_step: Any, gamma: Any, include_infos: bool,
                      include_extra_model_outputs: bool) -> None:
    """Refuse, by name, the ``sample`` arguments a table of these rows cannot honour.

    Raises:
        ValueError: the argument and what to set instead.
    """
    if batch_length_T not in (None, 0, 1):
        raise ValueError(f"sample(batch_length_T={batch_length_T}): this buffer samples "
                         f"rows (stateful modules need sequences: not supported)")
    if n_step is not None and n_step != n_step_stored:
        raise ValueError(f"sample(n_step={n_step!r}): the table builds {n_step_stored}-step "
                         f"returns; set replay_buffer_config's n_step to the algorithm's "
                         f"(an int) and use a new table or replay")
    if gamma is not None and n_step_stored > 1 and float(gamma) != gamma_stored:
        raise ValueError(f"sample(gamma={gamma}): the table discounts its n-step returns "
                         f"with gamma={gamma_stored}; set replay_buffer_config's gamma")
    if include_infos or include_extra_model_outputs:
        raise ValueError("sample(): include_infos and include_extra_model_outputs are not "
                         "stored by this buffer")


class BufferTable:
    """A replay's table behind an RLlib buffer (see the module docstring).

    Args:
        client: the ``ReplayClient`` of the replay (one server or sharded).
        name: the table; it must exist and be prioritized (:meth:`check`).
        beta: the importance-weight exponent its samples start with.
        prefetch: batches the sample stream draws ahead; 0: a call per sample.
        pending_adds: inserts on their way at once; 0: each add waits.
    """

    def __init__(self, client: Any, name: str, *, beta: float, prefetch: int,
                 pending_adds: int) -> None:
        self.name = name
        self._client = client
        self._prefetch = int(prefetch)
        self._pending_adds = int(pending_adds)
        self._adds: PendingAdds | None = None
        self._stream: Any = None  # the sample stream (prefetch > 0), opened by draw()
        self._stream_size = 0
        self.beta = float(beta)
        self.max_priority = 1.0
        self.last_ids = torch.empty(0, dtype=torch.int64)
        self._size_read = self._added_since_read = 0

    def check(self, info: Any = None) -> None:
        """Check the table is there and prioritized; read its size; set its beta.

        Raises:
            ConfigError: it is missing, or not prioritized (named).
        """
        info = self._client.info() if info is None else info
        if self.name not in info:
            raise ConfigError(f"the replay has no table {self.name!r} (it has "
                              f"{sorted(info)})")
        if info[self.name].sampler != "prioritized":
            raise ConfigError(f"table {self.name!r} samples {info[self.name].sampler!r}; "
                              f"the sharded RLlib buffers need a 'prioritized' one")
        self._size_read = int(info[self.name].size)  # a running replay's rows count too
        self._client.set_sampling(self.name, beta=self.beta)
        if self._pending_adds and self._adds is None:
            self._adds = PendingAdds(self._client, self.name, self._pending_adds)

    def add(self, rows: dict[str, Any], count: int, weight: float | None) -> None:
        """Insert ``count`` rows (in the background where ``pending_adds``), each with
        priority ``weight`` (``None``: the largest the table has seen).

        Raises:
            WriterError: an earlier background insert failed.
        """
        priorities = None
        if weight is not None:
            priorities = torch.full((count,), float(weight), dtype=torch.float64)
        if self._adds is not None:
            self._adds.put(rows, priorities, count)
        else:
            self._client.insert(self.name, rows, priorities=priorities)
        self._added_since_read += count

    def count_written(self, count: int) -> None:
        """Count ``count`` rows another writer (an env runner) inserted into the table: the
        :meth:`size` estimate takes them in, nothing is sent."""
        self._added_since_read += int(count)

    def draw(self, size: int, beta: float | None) -> Any:
        """The next batch of ``size`` rows (its ids kept in :attr:`last_ids`): from the
        sample stream (opened, or reopened for another size or ``beta``, here), or by a
        call where ``prefetch`` is 0."""
        if beta is not None and float(beta) != self.beta:
            self.flush()  # the stream's batches are drawn with the old beta
            self._client.set_sampling(self.name, beta=float(beta))
            self.beta = float(beta)
        if self._prefetch == 0:  # RLlib's own order: the rows added before are drawn from
            self.wait_for_adds()
            batch = self._client.sample(self.name, size)
        else:
            if self._stream is not None and self._stream_size != size:
                self.flush()
            if self._stream is None:
                self._stream = self._client.stream(self.name, size, prefetch=self._prefetch)
                self._stream_size = size
            batch = next(self._stream)
        self.last_ids = batch.ids.clone()
        return batch

    def update(self, values: np.ndarray) -> int | None:
        """Set the priorities of :attr:`last_ids`, in order (values below 1e-12 raised to it,
        as RLlib's buffers do). Returns the stale ids skipped where the update was a call
        (``prefetch=0``), ``None`` where it rides on the stream.

        Raises:
            ValueError: not one value per id (named); nothing applied.
        """
        if len(values) != len(self.last_ids):
            raise ValueError(f"update_priorities: {len(values)} priorities for the "
                             f"{len(self.last_ids)} rows of the last sample")
        if len(values) == 0:
            return None
        values = np.maximum(values, 1e-12)
        stale = None
        if self._stream is not None:  # on the stream's next credit: no round trip
            self._stream.update_priorities(self.last_ids, torch.from_numpy(values))
        else:
            applied = self._client.update_priorities(self.name, self.last_ids,
                                                     torch.from_numpy(values))
            stale = len(values) - int(applied or 0)
        self.max_priority = max(self.max_priority, float(values.max()))
        self.last_ids = torch.empty(0, dtype=torch.int64)
        return stale

    def size(self, *, estimate: bool = False) -> int:
        """Rows the table holds, over every shard (the adds on their way stored first).

        ``estimate``: without a round trip, the size last read plus the rows added here
        since (rows other writers put in the replay meanwhile are not in it)."""
        if estimate:
            return self._size_read + self._added_since_read
        self.wait_for_adds()
        self._size_read = int(self._client.info()[self.name].size)
        self._added_since_read = 0
        return self._size_read

    def flush(self) -> None:
        """Store the adds on their way, apply the updates riding on the sample stream, and
        close it (the next :meth:`draw` opens another).

        Raises:
            WriterError: an add on its way failed.
        """
        self.wait_for_adds()
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()

    def wait_for_adds(self) -> None:
        """Wait until the adds on their way are stored (raising the first that failed)."""
        if self._adds is not None:
            self._adds.wait()

    def close(self) -> None:
        """:meth:`flush`, then end the background adds (the client stays open)."""
        try:
            self.flush()
        finally:
            if self._adds is not None:
                self._adds.stop()


def open_replay(tables: list[dict[str, Any]], *, replay: str, num_shards: int, namespace: str,
                checkpoint_dir: str | None, checkpoint_interval_s: float, shard_options: Any,
                address: str | None,
                client_options: Mapping[str, Any] | None) -> tuple[ReplayCluster | None, Any]:
    """The replay a buffer keeps its rows in, and a client of it: ``address`` (a running
    replay: ``ray://ns/name`` or shard addresses; no cluster returned), else the
    :class:`ReplayCluster` ``replay``, made with ``tables`` or found running
    (``get_if_exists``).

    Raises:
        ReplayExistsError: the replay runs with other tables or shards (named).
    """
    if address is not None:
        return None, ReplayClient(address, **dict(client_options or {}))
    cluster = ReplayCluster.create(
        replay, tables=tables, num_shards=num_shards, checkpoint_dir=checkpoint_dir,
        checkpoint_interval_s=checkpoint_interval_s, shard_options=shard_options,
        namespace=namespace, get_if_exists=True)
    return cluster, cluster.client(**dict(client_options or {}))
