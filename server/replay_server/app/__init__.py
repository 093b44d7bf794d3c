"""The app layer: the ``replay-server`` command, config files, the embedded server.

``cli`` parses the command line and runs a server or an operator's command;
``config_file`` reads TOML into
:class:`~replay_server.service.settings.ServerSettings`; ``embedded`` runs a
server inside a learner's process; ``logs`` sets up logging. Nothing below
this layer imports it.
"""

from replay_server.app.config_file import load_settings, parse_field_spec, settings_from_dict
from replay_server.app.embedded import EmbeddedServer, stream_table
from replay_server.service.settings import ServerSettings

__all__ = [
    "EmbeddedServer",
    "ServerSettings",
    "load_settings",
    "parse_field_spec",
    "settings_from_dict",
    "stream_table",
]
