"""``replay-server`` with the CPU stand-in for CUDA and the simulated CUDA IPC backend.

Tests only (``start_server(..., module="tests.integration.ipc_standin_server")``):
a ``device = "cuda"`` table runs its device code on the CPU
(:func:`~replay_server.engine.storage.placement.cpu_stand_in`) and the CUDA IPC
transport's device operations are :class:`tests.integration.simulated_ipc.SimulatedIpc`'s
(``REPLAY_SIM_IPC_REFUSE_EXPORT=1``: one that cannot export handles).
"""

from __future__ import annotations

import os
import sys

from replay_feed.device_ipc import use_backend
from replay_server.app.cli import main
from replay_server.engine.storage.placement import cpu_stand_in
from tests.integration.simulated_ipc import SimulatedIpc

if __name__ == "__main__":
    use_backend(SimulatedIpc(refuse_export=os.environ.get("REPLAY_SIM_IPC_REFUSE_EXPORT") == "1"))
    with cpu_stand_in():
        code = main()
    sys.exit(code)
