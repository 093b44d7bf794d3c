"""``replay-server serve`` as a real process: starts with its default tables, stops on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import time


def test_serve_announces_default_tables_and_exits_cleanly_on_sigterm():
    process = subprocess.Popen(
        [sys.executable, "-m", "replay_server.cli", "serve", "--capacity", "1000"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = process.stderr.readline()
            if not line:
                break
            lines.append(line)
            if "ready" in line:
                break
        log = "".join(lines)
        assert "ready" in log, log
        for name in ("replay", "uniform", "slice", "prioritized_slice"):
            assert f"table {name!r}" in log
        assert "network service is not built yet" in log
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
