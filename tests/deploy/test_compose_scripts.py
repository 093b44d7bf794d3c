"""The compose actors and learner (deploy/compose/*.py), run for a bounded number of steps
against a real server serving deploy/replay.toml (on loopback, port 0)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from replay_client import ReplayClient
from tests.conftest import start_server

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_an_actor_and_the_learner_run_against_the_compose_config(tmp_path) -> None:
    config = (DEPLOY / "replay.toml").read_text()
    config = config.replace('"0.0.0.0:50051"', '"127.0.0.1:0"').replace(
        '"0.0.0.0:9100"', '"127.0.0.1:0"').replace(
        '"/var/lib/replay/checkpoints"', f'"{tmp_path / "checkpoints"}"')
    server = start_server(tmp_path, config)
    try:
        script = [sys.executable]
        actors = [subprocess.Popen([*script, str(DEPLOY / "compose/actor.py"), "--address",
                                    server.address, "--steps", "2200", "--episode-len", "100"],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
        # min_size_to_sample = 2000 and samples_per_insert = 4: the learner waits for the
        # actor, then may read 4 x 2200 rows; it takes 10 x 256
        learner = subprocess.run([*script, str(DEPLOY / "compose/learner.py"), "--address",
                                  server.address, "--batches", "10"],
                                 capture_output=True, text=True, timeout=300)
        outputs = [actor.communicate(timeout=300)[0] for actor in actors]
        assert [actor.returncode for actor in actors] == [0], outputs
        assert all("stopped after 2200 steps" in out for out in outputs), outputs
        assert learner.returncode == 0, learner.stdout + learner.stderr
        # 27 KiB batches: grouped over gRPC when the learner saw the table's schema as it
        # started, else one per message through the server's /dev/shm (same host).
        grouped = "batches_per_message=2 chosen" in learner.stderr
        transport = "grpc" if grouped else "shared_memory"
        assert f"stopped after 10 batches ({transport})" in learner.stderr, learner.stderr
        info = ReplayClient(server.address).info()
        assert (info["replay"].size, info["sequences"].size) == (2200, 2200)
        assert info["replay"].counters["sampled"] >= 10 * 256  # plus the prefetch window
        assert info["replay"].counters["priority_updates"] > 0
    finally:
        server.stop()
