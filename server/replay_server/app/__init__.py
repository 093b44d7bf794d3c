"""The app layer: the ``replay-server`` command, config files, the embedded server.

``cli`` parses the command line and runs a server or an operator's command
(``commands``: those that only talk to a server, and never load torch);
``config_file`` reads TOML into
:class:`~replay_server.service.settings.ServerSettings`; ``embedded`` runs a
server inside a learner's process; ``logs`` sets up logging. Nothing below
this layer imports it. The names below are loaded on first use, so that
importing ``replay_server.app.cli`` stays light.
"""

from __future__ import annotations

# ruff: noqa: F401 - the imports under TYPE_CHECKING are this package's exports

from typing import TYPE_CHECKING

from replay_proto.exports import lazy_exports

if TYPE_CHECKING:
    from replay_server.app.config_file import (
        load_settings,
        parse_field_spec,
        settings_from_dict,
    )
    from replay_server.app.embedded import EmbeddedServer, stream_table
    from replay_server.service.settings import ServerSettings
else:
    __getattr__, __dir__ = lazy_exports(__name__)
