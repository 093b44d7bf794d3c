"""``[server] shard``: a number, or ``"auto"``: the pod's ordinal in a Kubernetes StatefulSet.

A sharded replay needs each server to carry its own shard index (bits 56..62
of every id it issues; ``docs/scale-out.md``). On a StatefulSet every pod reads
the same config, so ``shard = "auto"`` takes the index from where the pod is:

1. the ``REPLAY_SHARD_INDEX`` environment variable, when set
   (``deploy/k8s/statefulset.yaml`` sets it from the pod's
   ``apps.kubernetes.io/pod-index`` label);
2. else the host name, when it ends in ``-<ordinal>`` (a StatefulSet pod's
   name, ``replay-server-2``, is its host name).

Anything else is a start-up error that says what to set. Pure functions.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from typing import Any

from replay_proto.id_layout import MAX_SHARD
from replay_server.engine import check_shard
from replay_server.errors import ConfigError

AUTO = "auto"
ENV = "REPLAY_SHARD_INDEX"
_ORDINAL = re.compile(r"^.+-(\d+)$")


def resolve_shard(value: Any, environ: Mapping[str, str] | None = None,
                  hostname: str | None = None) -> int:
    """The shard index ``value`` stands for (an int is checked and kept).

    Args:
        value: the configured ``shard``: an integer in [0, 127] or ``"auto"``.
        environ: where ``REPLAY_SHARD_INDEX`` is read (default: ``os.environ``).
        hostname: the host name (default: this host's).

    Raises:
        ConfigError: not an integer in range nor ``"auto"``; or ``"auto"``
            with a malformed ``REPLAY_SHARD_INDEX``, or with neither it nor a
            host name ending in ``-<ordinal>``.
    """
    if value != AUTO:
        if isinstance(value, str):
            raise ConfigError(f"server.shard must be an integer in [0, {MAX_SHARD}] or \"auto\", "
                              f"got {value!r}")
        return check_shard(value)
    environ = os.environ if environ is None else environ
    text = environ.get(ENV, "").strip()
    if text:
        if not text.isdigit() or int(text) > MAX_SHARD:
            raise ConfigError(f"server.shard = \"auto\": {ENV}={text!r} is not a shard index "
                              f"(an integer in [0, {MAX_SHARD}])")
        return int(text)
    host = socket.gethostname() if hostname is None else hostname
    found = _ORDINAL.match(host)
    if found is None or int(found.group(1)) > MAX_SHARD:
        raise ConfigError(
            f"server.shard = \"auto\" found no shard index: {ENV} is not set and the host name "
            f"{host!r} does not end in -<ordinal> in [0, {MAX_SHARD}] (as a StatefulSet pod's "
            f"does). Set {ENV} (deploy/k8s/statefulset.yaml sets it from the pod-index label) "
            f"or give server.shard as an integer")
    return int(found.group(1))
