"""Run a module as ``python -m`` would, after setting resource limits in this very process.

    python -m tests.launch [--rlimit NAME=SOFT:HARD ...] [--ignore-sigxfsz] MODULE [ARGS ...]

Tests start servers this way instead of with ``subprocess.Popen(preexec_fn=...)``.
A ``preexec_fn`` makes Python fork (not vfork), which runs gRPC's fork handlers
in the child of a test process holding gRPC channels: they restart gRPC's
poller thread there, ``Popen``'s ``close_fds`` then closes that poller's epoll
descriptor before ``exec``, and the poller aborts the child
(``ev_epoll1_linux.cc: epoll_wait error: Bad file descriptor``, SIGABRT), which
looked like a server dying at start under load (issue 23, finding 9). Without
a ``preexec_fn`` Python spawns with ``vfork``, which runs no fork handlers;
the limits are set here, after ``exec``. ``SOFT``/``HARD`` ``-1``: unlimited.
"""

from __future__ import annotations

import resource
import runpy
import signal
import sys


def main(argv: list[str]) -> None:
    args = list(argv)
    while args and args[0].startswith("--"):
        option = args.pop(0)
        if option == "--ignore-sigxfsz":
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit: EFBIG
        elif option == "--rlimit":
            name, _, values = args.pop(0).partition("=")
            soft, hard = (int(v) if int(v) >= 0 else resource.RLIM_INFINITY
                          for v in values.split(":"))
            resource.setrlimit(getattr(resource, f"RLIMIT_{name}"), (soft, hard))
        else:
            raise SystemExit(f"tests.launch: unknown option {option}")
    module, *rest = args
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
