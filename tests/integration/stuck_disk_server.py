"""``replay-server`` whose checkpoint reads hang like a stuck network file system.

Tests only (``start_server(..., module="tests.integration.stuck_disk_server")``,
or run with ``python -m``): reading a checkpoint's column file blocks, deaf
to the restore's cancellation as a read stuck in the kernel is, until the
file named by ``REPLAY_TEST_RELEASE_FILE`` exists. A FIFO can no longer
stand in for such a disk (the restore refuses special files unread).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from replay_server.app.cli import main
from replay_server.checkpoint.fileio import VerifiedReader


def hang_column_reads(release: Path) -> None:
    real = VerifiedReader.read_into

    def read_into(self: VerifiedReader, array) -> None:  # type: ignore[no-untyped-def]
        if "column-" in self.entry.name:
            while not release.exists():
                time.sleep(0.02)
        real(self, array)

    VerifiedReader.read_into = read_into  # type: ignore[method-assign]


if __name__ == "__main__":
    hang_column_reads(Path(os.environ["REPLAY_TEST_RELEASE_FILE"]))
    sys.exit(main())
