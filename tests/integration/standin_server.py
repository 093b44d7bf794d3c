"""``replay-server`` with the CPU stand-in for CUDA active: device tables on a machine without a GPU.

Tests only (``start_server(..., module="tests.integration.standin_server")``):
a table with ``device = "cuda"`` runs its device storage code on the CPU
(:func:`~replay_server.engine.storage.placement.cpu_stand_in`, for the whole process).
"""

from __future__ import annotations

import sys

from replay_server.app.cli import main
from replay_server.engine.storage.placement import cpu_stand_in

if __name__ == "__main__":
    with cpu_stand_in():
        code = main()
    sys.exit(code)
