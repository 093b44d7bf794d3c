"""Reading a batch out of a sample stream's region (``chunked._owned_batch``).

The server's ``sampled_in_region`` answer says where each tensor lies in the
region; the client copies the batch out (the region is the stream's next
request's) and refuses an answer that does not describe tensors inside the
region with :class:`~replay_client.errors.InternalError`, never a raw
protobuf or memory error.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from replay_client import chunked, errors
from replay_feed.shared_ring import SharedRing
from replay_proto.sample_codec import encode_ring_batch
from replay_proto.v1 import replay_pb2 as pb


@pytest.fixture
def region(tmp_path, monkeypatch) -> Iterator[SharedRing]:
    monkeypatch.setenv("REPLAY_SHM_DIR", str(tmp_path))
    ring = SharedRing.create(1, 1 << 16)
    ring.unlink()
    yield ring
    ring.close()


def _placed(region: SharedRing) -> tuple[bytes, dict[str, torch.Tensor]]:
    """A batch of 4 rows written into ``region`` as a server would, and its answer."""
    obs = region.view(0, 0, torch.float32, (4, 3))
    obs.copy_(torch.arange(12, dtype=torch.float32).reshape(4, 3))
    extras = [region.view(0, 64, torch.int64, (4,)), region.view(0, 128, torch.float32, (4,)),
              region.view(0, 192, torch.float64, (4,))]
    for extra, value in zip(extras, (torch.arange(10, 14), torch.ones(4),
                                     torch.full((4,), 0.25, dtype=torch.float64))):
        extra.copy_(value)
    return encode_ring_batch({"obs": obs}, extras, 0, 0, [0, 64, 128, 192]), {"obs": obs}


def test_the_batch_is_copied_out_of_the_region(region: SharedRing) -> None:
    raw, placed = _placed(region)
    batch = chunked._owned_batch(raw, region)
    assert batch.ids.tolist() == [10, 11, 12, 13]
    assert torch.equal(batch.columns["obs"], placed["obs"])
    placed["obs"].zero_()  # the next request's batch overwrites the region
    assert batch.columns["obs"].sum() == sum(range(12))  # the caller's own copy
    assert batch.probabilities.dtype == torch.float64


def test_an_answer_outside_the_region_or_garbage_is_an_internal_error(
        region: SharedRing) -> None:
    raw, _ = _placed(region)
    header = pb.SampleResponse.FromString(raw)
    header.columns[0].shape[:] = [4, 1 << 20]  # past the region's end
    with pytest.raises(errors.InternalError, match="sample_in_region"):
        chunked._owned_batch(header.SerializeToString(), region)
    with pytest.raises(errors.InternalError, match="sample_in_region"):
        chunked._owned_batch(b"\xff\xff\xff", region)
