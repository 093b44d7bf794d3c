"""Tests of TorchRL's buffers that say nothing about the buffer API a script uses.

Each entry: a regular expression on the test's node id, and why the test is
not applicable to a buffer whose rows live on a server. Kept short: a test
that a TorchRL user's code could depend on is never listed here, it passes
or fails.
"""

from __future__ import annotations

import re

NOT_APPLICABLE: list[tuple[str, str]] = [
]


def reason_not_applicable(nodeid: str) -> str:
    """Why the test at ``nodeid`` is not applicable ('' when it is)."""
    for pattern, reason in NOT_APPLICABLE:
        if re.search(pattern, nodeid):
            return reason
    return ""
