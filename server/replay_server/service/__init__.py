"""The gRPC service: a thin adapter over the engine (decode, call, encode).

Import direction: ``replay_proto`` <- engine <- ``service`` <- ``cli``.

Names are imported on first use (:mod:`replay_proto.exports`), so that a module of
this package (the settings a config file is read into) loads without grpc.
"""

from __future__ import annotations

# ruff: noqa: F401 - the imports under TYPE_CHECKING are this package's exports

from typing import TYPE_CHECKING

from replay_proto.exports import lazy_exports

if TYPE_CHECKING:
    from replay_server.service.server import ReplayServer
else:
    __getattr__, __dir__ = lazy_exports(__name__)
