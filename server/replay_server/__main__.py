"""``python -m replay_server``: the ``replay-server`` command."""

import sys

from replay_server.app.cli import main

sys.exit(main())
