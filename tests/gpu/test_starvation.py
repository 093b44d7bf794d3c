"""A learner with a fixed GPU step is not starved by its feed (skipped where CUDA is absent).

What a learner relies on is not that copies overlap some particular kernel,
but that the GPU never waits for data. Each path (in process, shared memory,
gRPC) feeds a loop whose step is a calibrated 10 ms kernel
(``benchmarks/starvation.py``'s :class:`CudaStep`: ``torch.cuda._sleep``, after
reading a byte of every tensor of the batch, so the step depends on the
copy); the same loop over batches already on the GPU is the reference, in
the same process, just before. The GPU's idle fraction comes from CUDA events
around every step, not from host timers.

Tolerance, stated: the fed loop takes at most 1/0.95 of the reference loop's
time (the issue's ">= 95%"), and the GPU idles at most 5% of the fed loop's
span beyond what it idles on preloaded data. Batches of 64 Atari rows (1.8 MB),
well within what each path delivers in 10 ms on a GPU machine (issue 13's
H100 figures: gRPC 183 batches/s of 256 rows).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from replay_client import ReplayClient  # noqa: E402
from replay_server import Table, TableConfig  # noqa: E402
from replay_server.app.embedded import stream_table  # noqa: E402

STEP_MS = 10.0
STEPS = 60
BATCH = 64
RATIO = 0.95
IDLE_SLACK = 0.05

CONFIG = """
[[tables]]
name = "frames"
capacity = 4000
sampler = "prioritized"
"""


def _rows(n: int) -> dict[str, torch.Tensor]:
    return {"frame": torch.randint(0, 255, (n, 4, 84, 84), dtype=torch.uint8),
            "reward": torch.randn(n), "action": torch.randint(0, 18, (n,))}


@pytest.fixture(scope="module")
def step():
    from starvation import CudaStep

    return CudaStep(STEP_MS)


@pytest.fixture(scope="module")
def address(tmp_path_factory):
    from tests.conftest import start_server

    proc = start_server(tmp_path_factory.mktemp("starve"), CONFIG)
    client = ReplayClient(proc.address)
    client.insert("frames", _rows(4000))
    client.close()
    yield proc.address
    proc.stop()


def _check_not_starved(step, open_stream) -> None:
    kept = []
    with open_stream() as warm:
        for _ in range(4):
            batch = next(warm)
            kept.append(batch.with_tensors([t.clone() for t in batch.tensors()]))
    torch.cuda.synchronize()
    reference = step.run(itertools.cycle(kept), STEPS)
    stream = open_stream()
    with stream:
        fed = step.run(stream, STEPS)
        assert stream.stats.pageable_copies == 0
    assert fed.seconds <= reference.seconds / RATIO, (fed, reference)
    assert fed.idle_fraction <= reference.idle_fraction + IDLE_SLACK, (fed, reference)


def test_an_in_process_feed_keeps_a_10ms_gpu_step_busy(step):
    table = Table(TableConfig(name="frames", capacity=4000, sampler="prioritized"))
    table.insert(_rows(4000))
    _check_not_starved(step, lambda: stream_table(table, BATCH, device="cuda"))


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "grpc"])
def test_a_network_feed_keeps_a_10ms_gpu_step_busy(step, address, shared_memory):
    client = ReplayClient(address)
    try:
        _check_not_starved(step, lambda: client.stream(
            "frames", BATCH, device="cuda", shared_memory=shared_memory))
    finally:
        client.close()
