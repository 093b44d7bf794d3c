"""8 actor processes write through Writers while a learner samples and updates priorities."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch

from replay_client import ReplayClient

ACTORS = 8
EPISODE = 60           # steps per episode
SLICE_LEN = 8


def _config(steps: int) -> str:
    return f"""
[server]
workers = 4

[[tables]]
name = "replay"
capacity = {ACTORS * steps}
sampler = "prioritized"

[[tables]]
name = "seq"
capacity = {ACTORS * steps}
sampler = "slice"
slice_len = {SLICE_LEN}
"""


def _actor(client: ReplayClient, actor: int, steps: int, results) -> None:
    try:
        with client.writer("replay", batch_rows=100) as flat, client.writer("seq", batch_rows=64) as seq:
            for step in range(steps):
                row = {"obs": torch.tensor([float(actor), float(step)]),
                       "done": (step + 1) % EPISODE == 0}
                flat.append(row)
                seq.append(row)
                if (step + 1) % EPISODE == 0:
                    seq.end_episode()
        results.put((actor, flat.rows_written, seq.rows_written, None))
    except BaseException as exc:  # reported to the test
        results.put((actor, 0, 0, repr(exc)))


def test_eight_actors_and_a_learner_lose_nothing(server_factory):
    _run(server_factory, steps=1500, time_limit_s=120)


@pytest.mark.slow
def test_eight_actors_and_a_learner_lose_nothing_at_length(server_factory):
    _run(server_factory, steps=30_000, time_limit_s=900)


def _run(server_factory, steps: int, time_limit_s: float) -> None:
    server = server_factory(_config(steps))
    client = ReplayClient(server.address, timeout=30)
    # forkserver: one process imports this module (torch, the client) and forks the 8 actors,
    # instead of 8 spawned interpreters importing torch each (about 1.5 CPU seconds apiece)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    results = context.Queue()
    actors = [context.Process(target=_actor, args=(client, a, steps, results))
              for a in range(ACTORS)]
    for process in actors:
        process.start()

    deadline = time.monotonic() + time_limit_s
    learner_steps = updates_applied = 0
    while any(p.is_alive() for p in actors) and time.monotonic() < deadline:
        if client.info()["replay"].size < 64:
            time.sleep(0.05)
            continue
        batch = client.sample("replay", 64)
        obs = batch.data["obs"]
        assert obs.shape == (64, 2)
        updates_applied += client.update_priorities("replay", batch.ids, obs[:, 1] % 7 + 0.5)
        learner_steps += 1

    for process in actors:
        process.join(timeout=max(1.0, deadline - time.monotonic()))
        assert process.exitcode == 0, f"actor {process.pid} exit code {process.exitcode}"
    reports = [results.get(timeout=5) for _ in actors]
    assert [r[3] for r in reports] == [None] * ACTORS, reports
    assert all(r[1] == steps and r[2] == steps for r in reports), reports
    assert learner_steps > 0 and updates_applied == learner_steps * 64

    info = client.info()
    for table in ("replay", "seq"):
        assert info[table].size == ACTORS * steps
        assert info[table].counters["inserted"] == ACTORS * steps
    # Every episode is complete: steps / EPISODE episodes per actor, each with
    # EPISODE - SLICE_LEN + 1 slice starts.
    expected_slices = ACTORS * (steps // EPISODE) * (EPISODE - SLICE_LEN + 1)
    assert info["seq"].sampler_stats["slices"] == expected_slices

    slices = client.sample("seq", 512).data["obs"]
    actor_ids, steps = slices[..., 0], slices[..., 1]
    assert bool((actor_ids == actor_ids[:, :1]).all()), "a slice mixes actors"
    assert bool((steps[:, 1:] - steps[:, :-1] == 1).all()), "a slice skips or reorders steps"
    assert bool(((steps[:, :1] // EPISODE) == (steps[:, -1:] // EPISODE)).all()), "crosses episodes"
