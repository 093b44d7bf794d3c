"""TorchRL's counting calls (``stats()``, ``write_count`` after ``empty``, ``initialized``) and
the refusals that name the alternative: a writer object, a write with no entries, new keys."""

from __future__ import annotations

import json

import pytest
import torch
from tensordict import TensorDict

from replay_client import RemoteReplayBuffer, errors
from tests.client.remote_buffer.data import rows


def test_stats_count_rows_and_writes_as_torchrl(client, fresh) -> None:
    rb = RemoteReplayBuffer(client, fresh("rows"), batch_size=2)
    assert rb.stats() == {"size": 0, "write_count": 0, "capacity": 10, "utilization": 0.0,
                          "prefetch_queue_size": 0, "initialized": True}
    rb.extend(rows(15))
    stats = rb.stats()
    assert (stats["size"], stats["write_count"], stats["utilization"]) == (10, 15, 1.0)
    rb.sample()
    assert rb.stats() == stats  # sampling changes none of it
    assert json.loads(json.dumps(stats)) == stats


def test_empty_starts_the_write_count_over_unless_asked_not_to(client, fresh) -> None:
    """rb.empty(empty_write_count=False) was a TypeError, and write_count outlived empty()."""
    rb = RemoteReplayBuffer(client, fresh("rows"))
    rb.extend(rows(6))
    rb.empty(empty_write_count=False)
    assert (len(rb), rb.write_count) == (0, 6)
    rb.empty()
    assert rb.write_count == 0
    rb.extend(rows(3))
    assert rb.stats()["write_count"] == 3


def test_a_delayed_buffer_is_initialized_by_its_first_write(client, fresh) -> None:
    rb = RemoteReplayBuffer(client, fresh("rows"), delayed_init=True)
    assert not rb.initialized and rb.stats()["initialized"] is False
    rb.extend(rows(3))
    assert rb.initialized


def test_the_writer_object_is_refused_naming_what_stands_for_it(client, fresh) -> None:
    rb = RemoteReplayBuffer(client, fresh("rows"))
    with pytest.raises(AttributeError, match="the table's ring is its writer"):
        rb.writer  # noqa: B018
    assert not hasattr(rb, "writer")


def test_a_write_with_no_entries_is_refused_before_it_reaches_the_server(client, fresh) -> None:
    rb = RemoteReplayBuffer(client, fresh("rows"))
    with pytest.warns(UserWarning, match="Using `add"), pytest.raises(
            errors.InvalidArgumentError, match="no entries .* a row needs at least one"):
        rb.add(TensorDict(batch_size=[1]))
    rb.extend(rows(2))  # the buffer goes on as before
    assert len(rb) == 2


def test_new_keys_after_the_first_write_are_refused_naming_the_way_out(client, fresh) -> None:
    rb = RemoteReplayBuffer(client, fresh("rows"))
    rb.extend(rows(2))
    more = rows(2)
    more["value"] = torch.zeros(2)
    with pytest.raises(errors.SchemaMismatchError, match="unexpected keys.*rb.empty"):
        rb.extend(more)
    rb.empty()
    rb.extend(more)
    assert "value" in rb.sample(2).keys()
