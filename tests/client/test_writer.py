"""The Writer against a real server: batching, delay flush, episodes, errors, backpressure."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch
from replay_client import ReplayClient, Writer, errors

from tests.conftest import module_server, stays, wait_for

CONFIG = """
[[tables]]
name = "t"
capacity = 10000

[[tables]]
name = "mixed"
capacity = 10

[[tables]]
name = "seq"
capacity = 10000
sampler = "slice"
slice_len = 3

[[tables]]
name = "plain"
capacity = 100

[[tables]]
name = "declared"
capacity = 100
[tables.schema]
x = "float32[]"
episode = "int64[]"
"""


server = module_server(CONFIG)


def test_flush_stores_every_appended_step(server):
    client = ReplayClient(server.address)
    client.reset("t")
    with client.writer("t", batch_rows=7) as writer:
        for step in range(50):
            writer.append({"obs": torch.full((3,), float(step)), "r": step * 0.5})
        writer.flush()
        assert client.info()["t"].size == 50
        assert writer.rows_written == 50


def test_a_partial_batch_is_sent_after_max_delay(server):
    client = ReplayClient(server.address)
    client.reset("t")
    writer = client.writer("t", batch_rows=1000, max_delay_s=0.1)
    try:
        for _ in range(3):
            writer.append({"obs": torch.zeros(3), "r": 1.0})
        assert wait_for(lambda: client.info()["t"].size == 3)
    finally:
        writer.close()


def test_steps_get_one_episode_id_per_episode(server):
    client = ReplayClient(server.address)
    with client.writer("seq", batch_rows=4) as writer:
        first = writer.episode_id
        for _ in range(5):
            writer.append({"x": 1.0})
        writer.end_episode()
        assert writer.episode_id != first
        for _ in range(5):
            writer.append({"x": 2.0})
    batch = client.sample("seq", 200)
    # Slices never mix the two episodes.
    assert bool((batch.data["x"] == batch.data["x"][:, :1]).all())
    assert set(batch.data["episode"][:, 0].tolist()) <= {first, writer.episode_id}


def test_the_writer_adds_episode_ids_only_where_the_table_keeps_them(server):
    """A writer on a plain uniform table (the README's ``replay``) added an ``episode``
    column the table refused (``SchemaMismatchError: unexpected keys ['episode']``)."""
    client = ReplayClient(server.address)
    with client.writer("plain", batch_rows=4) as writer:
        for step in range(6):
            writer.append({"x": float(step)})
    info = client.info()
    assert info["plain"].size == 6 and set(info["plain"].schema) == {"x"}
    with client.writer("declared", batch_rows=4) as writer:  # the schema has the column
        for step in range(6):
            writer.append({"x": float(step)})
    assert set(client.sample("declared", 10).data["episode"].tolist()) == {writer.episode_id}
    writer = client.writer("plain", episode_key="run")  # asked for: the table refuses it
    writer.append({"x": 1.0})
    with pytest.raises(errors.WriterError, match="unexpected keys \\['run'\\]"):
        writer.flush()
    with pytest.raises(errors.WriterError):
        writer.close()
    with pytest.raises(errors.UnknownTableError, match="nope"):
        client.writer("nope")


def test_a_step_with_another_layout_is_refused_at_append(server):
    writer = ReplayClient(server.address).writer("t")
    try:
        writer.append({"obs": torch.zeros(3), "r": 1.0})
        with pytest.raises(errors.InvalidArgumentError, match="key 'obs' was float32\\[3\\], now float32\\[4\\]"):
            writer.append({"obs": torch.zeros(4), "r": 1.0})
        with pytest.raises(errors.InvalidArgumentError, match="missing keys \\['r'\\]"):
            writer.append({"obs": torch.zeros(3)})
    finally:
        writer.close()


def test_a_failed_background_insert_surfaces_with_its_cause_and_lost_rows(server):
    client = ReplayClient(server.address)
    client.insert("t", {"obs": torch.zeros(1, 3), "r": torch.zeros(1)})
    writer = client.writer("t", batch_rows=5)
    for _ in range(5):  # float64 obs: the table stores float32, so this insert fails
        writer.append({"obs": torch.zeros(3, dtype=torch.float64), "r": 0.0})
    with pytest.raises(errors.WriterError, match="5 rows were not stored") as raised:
        writer.flush()
    assert isinstance(raised.value.__cause__, errors.SchemaMismatchError)
    with pytest.raises(errors.WriterError):
        writer.append({"obs": torch.zeros(3, dtype=torch.float64), "r": 0.0})
    with pytest.raises(errors.WriterError):
        writer.close()


def test_append_blocks_at_max_pending_rows_while_the_server_is_stalled(tmp_path):
    from tests.conftest import start_server

    proc = start_server(tmp_path, CONFIG)
    try:
        writer = Writer(ReplayClient(proc.address, timeout=60), "t", batch_rows=10,
                        max_pending_rows=30)
        writer.append({"obs": torch.zeros(3), "r": 0.0})
        writer.flush()  # connected and schema fixed
        os.kill(proc.process.pid, signal.SIGSTOP)
        appended = []

        def actor() -> None:
            for _ in range(100):
                writer.append({"obs": torch.zeros(3), "r": 0.0})
                appended.append(1)

        thread = threading.Thread(target=actor, daemon=True)
        thread.start()
        assert wait_for(lambda: len(appended) >= 30)
        assert stays(lambda: len(appended) == 30), (
            "append must block once max_pending_rows are in flight")
        assert thread.is_alive()
        os.kill(proc.process.pid, signal.SIGCONT)
        thread.join(timeout=30)
        assert len(appended) == 100
        writer.close()
        assert ReplayClient(proc.address).info()["t"].size == 101
    finally:
        os.kill(proc.process.pid, signal.SIGCONT)
        proc.stop()


def test_invalid_options_are_refused():
    client = ReplayClient("127.0.0.1:1")
    with pytest.raises(ValueError, match="batch_rows"):
        Writer(client, "t", batch_rows=0)
    with pytest.raises(ValueError, match="max_pending_rows"):
        Writer(client, "t", batch_rows=10, max_pending_rows=5)


def test_every_dtype_and_scalar_steps_arrive_bit_exact(server):
    client = ReplayClient(server.address)
    steps = [
        {"f32": torch.randn(2), "bf16": torch.randn(2).bfloat16(),
         "u8": torch.tensor([i, 255 - i], dtype=torch.uint8),
         "reward": i / 3, "action": i, "done": i % 2 == 0}
        for i in range(10)
    ]
    with client.writer("mixed", batch_rows=4) as writer:
        for step in steps:
            writer.append(step)
    batch = client.sample("mixed", 300)
    assert batch.data["bf16"].dtype == torch.bfloat16 and batch.data["reward"].dtype == torch.float32
    for row in range(300):
        step = steps[int(batch.data["action"][row])]
        for key in ("f32", "bf16", "u8"):
            assert torch.equal(batch.data[key][row], step[key]), key
        assert float(batch.data["reward"][row]) == torch.tensor(step["reward"]).item()
        assert bool(batch.data["done"][row]) == step["done"]


def test_steps_are_copied_at_append_so_buffers_can_be_reused(server):
    client = ReplayClient(server.address)
    client.reset("t")
    buffer = torch.zeros(3)
    with client.writer("t", batch_rows=100) as writer:
        for step in range(5):
            buffer.fill_(float(step))  # an actor reusing one observation buffer
            writer.append({"obs": buffer, "r": 0.0})
    values = sorted(set(client.sample("t", 200).data["obs"][:, 0].tolist()))
    assert values == [0.0, 1.0, 2.0, 3.0, 4.0]


class _RecordingInserter:
    """Keeps a copy of every insert, and which memory each batch came in."""

    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []
        self.buffers: set[int] = set()

    def insert(self, table: str, data):
        self.buffers.add(data["obs"].data_ptr())
        self.rows.append(data["obs"].clone())


def test_sent_batches_columns_are_reused_and_every_step_arrives_intact():
    inserter = _RecordingInserter()
    with Writer(inserter, "t", batch_rows=8, max_pending_rows=16, episode_key=None) as writer:
        for step in range(200):
            writer.append({"obs": torch.full((4,), float(step))})
    got = torch.cat(inserter.rows)
    assert torch.equal(got[:, 0], torch.arange(200.0))  # in order, none overwritten in flight
    assert torch.equal(got, got[:, :1].expand(-1, 4))
    # 25 batches went through a few column sets (spares plus those pending), not 25.
    assert len(inserter.buffers) <= 2 + 16 // 8 + 1
