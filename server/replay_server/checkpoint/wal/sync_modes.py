"""What each ``wal_sync`` mode promises about an acknowledged change (one line per mode).

The log keeper says it when it opens the log, ``check-config`` when it reads a
config, and the settings accept exactly these modes; a module of its own, so
that reading a config loads none of the log's machinery.
"""

from __future__ import annotations

SYNC_PROMISES = {"fsync": "an acknowledged change survives a crash of the process or the machine",
                 "os": "an acknowledged change survives a crash of the process (not of the "
                       "machine: power loss can lose the last ones)"}
"""``wal_sync`` value -> what it promises."""
