"""A server process started ahead of need: ``python -m tests.spare``.

Most of a server's start is importing torch (about 1.5 CPU seconds on this
machine; the rest of the start is a tenth of that). :func:`tests.conftest.start_server`
keeps one spare process that has already imported the server's modules,
started while the previous test ran; a start hands it its command line and
its log file, and it runs ``replay-server`` exactly as ``python -m
replay_server.app.cli`` would, in the same process.

Protocol: once imported, the spare writes ``ready`` on its stdout (a pipe);
then it reads one JSON line from stdin, ``{"args": [...], "log": PATH,
"prelude": PATH}``, copies the prelude (its stderr until then) into the log,
points stdout and stderr at the log file (appending) and stdin at
``/dev/null``, and exits with ``cli.main(args)``'s status. Stdin closed
without a line: it exits 0 without serving (a spare no start needed).
"""

from __future__ import annotations

import json
import os
import sys

from replay_server.app import cli, config_file, heap, logs  # noqa: F401  # what serve imports
from replay_server.service import loop, server, settings  # noqa: F401  # torch, gRPC: paid ahead


def main() -> int:
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    order = json.loads(line)
    log = os.open(order["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    prelude = order["prelude"]  # what this process printed while importing, as a cold start would
    with open(prelude, "rb") as early:
        os.write(log, early.read())
    os.unlink(prelude)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.dup2(null, 0)
    os.close(log)
    os.close(null)
    return cli.main(order["args"])


if __name__ == "__main__":
    sys.exit(main())
