"""Which shard owns each id: ids carry their server's shard index in bits 56..62
(:mod:`replay_proto.id_layout`).

Pure functions over numpy arrays, shared by the sharded client's per-id calls
(``update_priorities``, ``delete``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from replay_client.errors import InvalidIdsError
from replay_proto.id_layout import shard_of


def by_owner(ids: np.ndarray, shards: Iterable[int], nothing_done: str) -> dict[int, np.ndarray]:
    """The positions in ``ids`` (flat int64) of each owning shard's ids.

    Cost: O(len(ids) * shards). Checked whole first, so a bad id refuses the
    whole call and nothing is sent.

    Args:
        ids: flat int64 ids.
        shards: this client's shard indices.
        nothing_done: what the error adds (e.g. "nothing was updated").

    Raises:
        InvalidIdsError: an id is negative or belongs to no shard in ``shards``.
    """
    known_shards = np.fromiter(shards, dtype=np.int64)
    owners = shard_of(ids)
    known = np.isin(owners, known_shards)
    if not known.all():
        first = int(np.flatnonzero(~known)[0])
        raise InvalidIdsError(
            f"id {int(ids[first])} (index {first}) "
            + ("is negative, not an id" if ids[first] < 0 else
               f"belongs to shard {int(owners[first])}, which is not among this client's "
               f"shards {known_shards.tolist()}") + f"; {nothing_done}")
    return {int(s): np.flatnonzero(owners == s) for s in np.unique(owners).tolist()}


def calling(method: str, *args: Any) -> Callable[[Any], Any]:
    """``client -> client.<method>(*args)``: one shard's part of a call, its arguments bound
    now (a lambda in a loop would see the loop's last ones)."""
    return lambda client: getattr(client, method)(*args)
