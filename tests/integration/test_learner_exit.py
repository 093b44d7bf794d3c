"""A learner process ends on its own while a stream is open: by the end of its script, by Ctrl-C,
or by an exception in its loop; it must exit within seconds on every transport.

Each case is a real learner subprocess against real servers (two shards for the sharded
stream) that leaves its stream open: ``it = iter(client.stream(...)); next(it)``, then
the ending. Streams used to hang the interpreter's exit forever (a finaliser blocked on a
gRPC lock held by a thread the interpreter had frozen). The deadline is counted from the
moment the script ends (or the signal is sent), not from its start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest

from tests.conftest import ServerProcess, start_server

EXIT_DEADLINE_S = 30.0
"""A hang is forever (the bug this guards against); an exit takes well under a second alone but
seconds on a loaded 2-core machine, so the deadline catches the hang without timing the exit."""
START_S = 120.0

LEARNER = textwrap.dedent("""
    import signal
    import sys
    # Ctrl-C raises KeyboardInterrupt, as in a terminal, even when the test runner was
    # started in the background (a shell without job control starts it with SIGINT ignored,
    # and an ignored signal stays ignored in every process it starts).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import torch
    transport, ending, addresses = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    if transport == "in_process":
        from replay_server.app import EmbeddedServer, settings_from_dict
        server = EmbeddedServer(settings_from_dict(
            {"tables": [{"name": "t", "capacity": 100, "sampler": "prioritized"}]}),
            listen=False)
        server.tables["t"].insert({"x": torch.arange(50)})
        stream = server.stream("t", 8)
    else:
        from replay_client import ReplayClient
        client = ReplayClient(addresses if transport == "sharded" else addresses[0])
        for _ in range(2):
            client.insert("t", {"x": torch.arange(50)})
        stream = client.stream("t", 8, batches_per_message=1,
                               shared_memory=transport != "grpc")
    it = iter(stream)
    batch = next(it)
    if transport != "in_process":  # the client's update stream and background updater, open too
        client.update_priorities("t", batch.ids, torch.ones(8))
        client.update_priorities("t", batch.ids, torch.ones(8), wait=False)
    print("READY", stream.transport, flush=True)
    if ending == "interrupt":
        while True:  # the learner's loop, until Ctrl-C
            next(it)
    print("END", flush=True)
    if ending == "exception":
        raise RuntimeError("the learner's loop failed")
""")

CONFIG = """
[server]
shard = {shard}

[[tables]]
name = "t"
capacity = 1000
sampler = "prioritized"
"""


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Iterator[list[ServerProcess]]:
    tmp = tmp_path_factory.mktemp("exit")
    procs = [start_server(tmp, CONFIG.format(shard=s), name=f"shard{s}") for s in (0, 1)]
    yield procs
    for proc in procs:
        proc.stop()


def _leaked_rings(procs: list[ServerProcess]) -> list[str]:
    """The servers' rings left in /dev/shm (not their sockets for same-host updates, which
    live as long as the server: ``replay_server.service.local_updates``)."""
    prefixes = tuple(f"replay-{p.process.pid}-" for p in procs)
    return [name for name in os.listdir("/dev/shm")
            if name.startswith(prefixes) and not name.endswith(".sock")]


@pytest.mark.parametrize("ending", ["script_end", "interrupt", "exception"])
@pytest.mark.parametrize("transport", ["grpc", "shared_memory", "in_process", "sharded"])
def test_a_learner_with_an_open_stream_exits_within_seconds(shards, tmp_path, transport,
                                                            ending) -> None:
    script = tmp_path / "learner.py"
    script.write_text(LEARNER)
    addresses = ",".join(p.address for p in shards)
    learner = subprocess.Popen(
        [sys.executable, str(script), transport, ending, addresses],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = _line(learner, "READY", START_S)
        assert line.split()[1] == {"grpc": "grpc", "shared_memory": "shared_memory",
                                   "in_process": "in_process", "sharded": "sharded"}[transport]
        if ending == "interrupt":
            time.sleep(0.2)  # inside its loop
            learner.send_signal(signal.SIGINT)
        else:
            _line(learner, "END", START_S)
        ended = time.monotonic()
        try:
            code = learner.wait(timeout=EXIT_DEADLINE_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the learner ({transport}, {ending}) was still running "
                        f"{EXIT_DEADLINE_S} s after its end")
        took = time.monotonic() - ended
        stderr = learner.stderr.read()
    finally:
        if learner.poll() is None:
            learner.kill()
            learner.wait()
    expected = {"script_end": 0, "exception": 1, "interrupt": -signal.SIGINT}[ending]
    assert code == expected, (code, took, stderr[-2000:])
    if ending != "script_end":
        assert ("KeyboardInterrupt" if ending == "interrupt" else "RuntimeError") in stderr
    assert "terminate called" not in stderr and "Fatal Python error" not in stderr, stderr
    assert not _leaked_rings(shards)


def _line(process: subprocess.Popen, marker: str, timeout: float) -> str:
    """The child's next stdout line starting with ``marker`` (fails if it ends first)."""
    deadline = time.monotonic() + timeout
    assert process.stdout is not None
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if line.startswith(marker):
            return line
        if not line and process.poll() is not None:
            pytest.fail(f"the learner ended before {marker}: {process.stderr.read()[-3000:]}")
    pytest.fail(f"no {marker} from the learner within {timeout} s")
