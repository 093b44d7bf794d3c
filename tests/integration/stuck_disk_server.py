"""``replay-server`` whose checkpoint reads hang like a stuck network file system.

Tests only (``start_server(..., module="tests.integration.stuck_disk_server")``,
or run with ``python -m``): reading a checkpoint's column file blocks, deaf
to the restore's cancellation as a read stuck in the kernel is, until the
file named by ``REPLAY_TEST_RELEASE_FILE`` exists. When the first read blocks, the
file named by ``REPLAY_TEST_BLOCKED_FILE`` (if set) is created, so that a test can
act once the restore is stuck in the read rather than on its way to it. A FIFO can
no longer stand in for such a disk (the restore refuses special files unread).
``REPLAY_TEST_RESTORE_STOP_S`` (if set) replaces the seconds a signalled restore has to
stop before it is left behind (``RESTORE_STOP_S``, 5 s), so that a test of a restore that
never stops need not wait them all.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from replay_server.app.cli import main
from replay_server.service import server as service_server
from replay_server.checkpoint.fileio import VerifiedReader


def hang_column_reads(release: Path, blocked: Path | None = None) -> None:
    real = VerifiedReader.read_into

    def read_into(self: VerifiedReader, array) -> None:  # type: ignore[no-untyped-def]
        if "column-" in self.entry.name:
            if blocked is not None and not release.exists():
                blocked.touch()
            while not release.exists():
                time.sleep(0.02)
        real(self, array)

    VerifiedReader.read_into = read_into  # type: ignore[method-assign]


if __name__ == "__main__":
    blocked = os.environ.get("REPLAY_TEST_BLOCKED_FILE")
    if "REPLAY_TEST_RESTORE_STOP_S" in os.environ:
        service_server.RESTORE_STOP_S = float(os.environ["REPLAY_TEST_RESTORE_STOP_S"])
    hang_column_reads(Path(os.environ["REPLAY_TEST_RELEASE_FILE"]),
                      Path(blocked) if blocked else None)
    sys.exit(main())
