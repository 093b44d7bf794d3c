"""docs/scale-out.md's local shards, run as written: the shell loop, then the client block.

Issue 32, friction 1: the loop took ports 50050-50052, and 50051 is ``make serve``'s (shard
1 failed after a raw gRPC line); the client block listed one shard, and listing the three
gave ``ShardingError: ... both report shard 0``. Here the loop runs in a shell with
``replay-server`` on its PATH, on three free ports in place of the doc's 50061-50063, and
the client block runs against the three servers it started.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

from replay_client import ReplayClient, errors
from tests.conftest import wait_for

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "scale-out.md"
DOC_PORTS = (50061, 50062, 50063)


def _block(language: str, containing: str) -> str:
    blocks = re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), re.DOTALL)
    return next(b for b in blocks if containing in b)


def _three_free_ports() -> int:
    """A base port whose next two are free too (each bound and released to check)."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            base = first.getsockname()[1]
        if base + 2 > 65535:
            continue
        try:
            for port in (base, base + 1, base + 2):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no three consecutive free ports on 127.0.0.1")


def _serving(address: str) -> bool:
    try:
        with ReplayClient(address, timeout=2, max_retry_s=0) as client:
            client.info()
        return True
    except errors.ReplayError:
        return False


def test_the_three_local_shards_of_the_doc_serve_one_replay(tmp_path) -> None:
    loop, code = _block("bash", "shard$i.toml"), _block("python", "localhost:50061")
    assert str(DOC_PORTS[0]) in loop and all(f"localhost:{p}" in code for p in DOC_PORTS)
    base = _three_free_ports()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    shell = subprocess.Popen(["bash", "-c", loop.replace(str(DOC_PORTS[0]), str(base))],
                             cwd=tmp_path, env=env, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    addresses = [f"127.0.0.1:{base + i}" for i in range(3)]
    try:
        shell.wait(timeout=30)  # the loop only starts them
        assert wait_for(lambda: all(_serving(a) for a in addresses), timeout=120), (
            f"the doc's shards did not serve: {shell.stderr.read().decode()[-2000:]}")
        for doc_port, address in zip(DOC_PORTS, addresses):
            code = code.replace(f"localhost:{doc_port}", address)
        exec(compile(code, "<docs/scale-out.md>", "exec"), {"__name__": "__doc_example__"})
        with ReplayClient(addresses) as client:
            assert sorted(client.shards) == [0, 1, 2]
            assert client.info()["uniform"].size == 8
    finally:
        os.killpg(shell.pid, signal.SIGTERM)
        assert wait_for(lambda: not any(_serving(a) for a in addresses), timeout=60)
