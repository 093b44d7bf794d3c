"""Test servers forked from one imported process: ``python -m tests.spare``.

Most of a server's start is importing torch, gRPC and the server's modules
(1.5-2.5 CPU seconds on this machine; the rest of the start is a tenth of
that), and the suite starts a few hundred servers on 2 cores that are busy
throughout: that import was a fifth of the suite's CPU. So one process per
test worker imports them once (this module) and forks each plain server
start from that state, as a PyTorch ``DataLoader`` forks its workers (nothing
here has started a thread, a gRPC channel or an event loop before the fork).
:func:`tests.conftest.start_server` uses it for a plain start (no rlimits, no
other module, no extra environment), else starts the server cold, as before.

Protocol, one line each way. The zygote writes ``ready`` once imported, then
reads JSON orders from stdin: ``{"args": [...], "log": PATH}``. For each it
forks a child that copies the zygote's own import-time output (its stderr
until then, the ``prelude`` file named on the command line) into the log,
points stdout and stderr at the log (appending) and stdin at ``/dev/null``,
seeds Python's and numpy's random generators afresh (a cold start would
have), and runs ``replay-server`` exactly as ``python -m replay_server.app.cli``
would, exiting with its status (atexit hooks and all). The zygote answers
``pid N``, and writes ``exit N STATUS`` when it reaps a child (``STATUS`` as
``Popen.returncode``: negative for a signal). Stdin closed: it takes no more
orders, and exits once its children have.
"""

from __future__ import annotations

import json
import os
import select
import sys

from replay_server.app import cli, config_file, heap, logs  # noqa: F401  # what serve imports
from replay_server.service import loop, server, settings  # noqa: F401  # torch, gRPC: paid once


def _child(order: dict, prelude: str) -> None:
    """In the forked child: become the server of ``order`` (never returns)."""
    import random

    import numpy as np

    log = os.open(order["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    with open(prelude, "rb") as early:  # what a cold start would have printed importing
        os.write(log, early.read())
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.dup2(null, 0)
    os.close(log)
    os.close(null)
    random.seed()
    np.random.seed()
    sys.exit(cli.main(order["args"]))


def _status(raw: int) -> int:
    return -os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)


def _reap(out) -> int:
    """Report every child that has exited; the children still running."""
    while True:
        try:
            pid, raw = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return 0
        if pid == 0:
            return 1
        out.write(f"exit {pid} {_status(raw)}\n")
        out.flush()


def main(prelude: str) -> int:
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    taking = True
    while True:
        readable, _, _ = select.select([sys.stdin] if taking else [], [], [], 0.05)
        if readable:
            line = sys.stdin.readline()
            if not line:
                taking = False
            elif line.strip():
                order = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(order, prelude)
                out.write(f"pid {pid}\n")
                out.flush()
        if not _reap(out) and not taking:
            return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
