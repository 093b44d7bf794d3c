"""The Writer's column copy against a plain reference: the same rows, bit for bit.

``Writer.append`` copies each step straight into preallocated columns (byte copies,
episode ids filled by slice); the reference here is today's contract written the
simple way: each step flattened, converted to tensors one by one, stamped with the
episode id current at its ``append``, and cut into batches of ``batch_rows`` (and
partial batches at ``flush``/``close``). Random step streams mix every dtype, 0-d to
3-d shapes (and rows past 500 elements), Python numbers, numpy arrays, non-contiguous and grad-requiring tensors,
nested keys, reused buffers and random bit patterns (NaN payloads included).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from replay_client import Writer, errors

from replay_proto.dtypes import DTYPES
from replay_proto.keys import flatten


class _Recorder:
    """An inserter that keeps a copy of every batch, in order."""

    def __init__(self) -> None:
        self.batches: list[dict[str, torch.Tensor]] = []

    def insert(self, table: str, data):
        self.batches.append({key: value.clone() for key, value in data.items()})


class _Reference:
    """Today's writer, the simple way: one step at a time, one tensor per value."""

    def __init__(self, batch_rows: int, episode_key: str | None) -> None:
        self.batch_rows = batch_rows
        self.episode_key = episode_key
        self.pending: list[dict[str, torch.Tensor]] = []
        self.batches: list[dict[str, torch.Tensor]] = []

    def append(self, step, episode: int) -> None:
        row = {}
        for key, value in flatten(step).items():
            if isinstance(value, torch.Tensor):
                row[key] = value.detach().clone()
            elif isinstance(value, np.ndarray):
                row[key] = torch.from_numpy(value.copy())
            else:
                row[key] = torch.as_tensor(value)
        if self.episode_key is not None:
            row[self.episode_key] = torch.tensor(episode, dtype=torch.int64)
        self.pending.append(row)
        if len(self.pending) == self.batch_rows:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self.batches.append({key: torch.stack([row[key] for row in self.pending])
                                 for key in self.pending[0]})
            self.pending = []


def _random_bits(rng: random.Random, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Any bit pattern of ``dtype`` (0/1 for bool), NaNs with payloads included."""
    if dtype == torch.bool:
        return torch.tensor(np.array(rng.choices([False, True], k=int(np.prod(shape)))),
                            dtype=torch.bool).reshape(shape)
    raw = bytes(rng.getrandbits(8) for _ in range(int(np.prod(shape)) * dtype.itemsize))
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape).clone()


class _Stream:
    """A random layout (nested keys, dtypes, shapes) and steps of it in random forms."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.layout = {}
        for i in range(rng.randint(1, 6)):
            dtype = rng.choice(list(DTYPES.values()))
            shape = tuple(rng.randint(1, 4) for _ in range(rng.choice([0, 0, 1, 2, 3])))
            if rng.random() < 0.2:  # past 500 elements: copied with the GIL released
                shape = (rng.randint(1, 3), rng.randint(501, 700))
            key = f"k{i}" if rng.random() < 0.7 else f"group/k{i}"
            self.layout[key] = (dtype, shape)
        self.buffers: dict[str, torch.Tensor] = {}

    def step(self) -> dict:
        step: dict = {}
        for key, (dtype, shape) in self.layout.items():
            value = self._value(key, dtype, shape)
            head, _, tail = key.partition("/")
            if tail:
                step.setdefault(head, {})[tail] = value
            else:
                step[key] = value
        return step

    def _value(self, key: str, dtype: torch.dtype, shape: tuple[int, ...]):
        rng = self.rng
        bits = _random_bits(rng, dtype, shape)
        form = rng.random()
        if not shape and form < 0.3:  # a Python number of the column's dtype
            if dtype == torch.bool:
                return bool(bits)
            if dtype == torch.int64:
                return int(bits)
            if dtype == torch.float32:
                return float(rng.uniform(-1e6, 1e6))
        if form < 0.4:
            return bits.numpy() if dtype != torch.bfloat16 else bits
        if form < 0.5 and len(shape) >= 2:  # a non-contiguous view of the same values
            return bits.transpose(0, 1).contiguous().transpose(0, 1)
        if form < 0.6 and dtype.is_floating_point:
            return bits.requires_grad_()
        if form < 0.8:  # the actor's own buffer, overwritten after the append
            buffer = self.buffers.setdefault(key, torch.empty(shape, dtype=dtype))
            buffer.copy_(bits)
            return buffer
        return bits


def _bytes(batches: list[dict[str, torch.Tensor]]) -> list[dict[str, bytes]]:
    def raw(tensor: torch.Tensor) -> bytes:
        tensor = tensor.detach().contiguous()
        return tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b""

    return [{key: (str(value.dtype), tuple(value.shape), raw(value))
             for key, value in batch.items()} for batch in batches]


@pytest.mark.parametrize("seed", range(12))
def test_random_step_streams_give_the_reference_rows_bit_for_bit(seed):
    rng = random.Random(seed)
    stream = _Stream(rng)
    batch_rows = rng.choice([1, 3, 8, 32])
    episode_key = rng.choice(["episode", None])
    recorder = _Recorder()
    reference = _Reference(batch_rows, episode_key)
    writer = Writer(recorder, "t", batch_rows=batch_rows, max_pending_rows=batch_rows * 4,
                    max_delay_s=3600.0, episode_key=episode_key)
    for _ in range(rng.randint(20, 150)):
        action = rng.random()
        if action < 0.08:
            writer.end_episode()
        elif action < 0.12:
            writer.flush()
            reference.flush()
        else:
            step = stream.step()
            reference.append(step, writer.episode_id)
            writer.append(step)
    writer.close()
    reference.flush()
    assert writer.rows_written == sum(len(next(iter(b.values()))) for b in reference.batches)
    assert _bytes(recorder.batches) == _bytes(reference.batches)


def test_episode_ids_change_exactly_at_end_episode_across_batches():
    recorder = _Recorder()
    writer = Writer(recorder, "t", batch_rows=4, max_delay_s=3600.0)
    expected = []
    for length in (1, 6, 3, 9, 2):
        for _ in range(length):
            expected.append(writer.episode_id)
            writer.append({"x": 1.0})
        writer.end_episode()
        writer.end_episode()  # an empty episode changes nothing stored
    writer.close()
    got = torch.cat([batch["episode"] for batch in recorder.batches]).tolist()
    assert got == expected
    assert len(set(got)) == 5


def test_a_step_of_another_layout_mid_stream_is_refused_and_loses_nothing():
    recorder = _Recorder()
    writer = Writer(recorder, "t", batch_rows=4, max_delay_s=3600.0, episode_key=None)
    good = [{"obs": torch.full((2, 3), float(i)), "action": torch.tensor(i)} for i in range(10)]
    for step in good[:6]:
        writer.append(step)
    bad_steps = [
        ({"obs": torch.zeros(3, 2), "action": torch.tensor(0)},
         "key 'obs' was float32\\[2, 3\\], now float32\\[3, 2\\]"),
        ({"obs": torch.zeros(2, 3, dtype=torch.float64), "action": torch.tensor(0)},
         "key 'obs' was float32\\[2, 3\\], now float64\\[2, 3\\]"),
        ({"obs": torch.zeros(2, 3)}, "missing keys \\['action'\\], unexpected keys \\[\\]"),
        ({"obs": torch.zeros(2, 3), "act": torch.tensor(0)},
         "missing keys \\['action'\\], unexpected keys \\['act'\\]"),
        ({"obs": torch.zeros(2, 3), "action": "left"}, "key 'action'"),
        ({"obs": torch.zeros(2, 3), "action": 2**70}, "key 'action'"),
    ]
    for bad, message in bad_steps:
        with pytest.raises(errors.InvalidArgumentError, match=message):
            writer.append(bad)
    for step in good[6:]:
        writer.append(step)
    writer.close()
    assert [len(b["obs"]) for b in recorder.batches] == [4, 4, 2]
    obs = torch.cat([b["obs"] for b in recorder.batches])
    assert torch.equal(obs, torch.stack([s["obs"] for s in good]))
    assert torch.cat([b["action"] for b in recorder.batches]).tolist() == list(range(10))


def test_a_negated_view_is_stored_as_its_values_not_its_memory():
    """``conj().imag`` of a complex tensor is a float tensor whose memory holds the
    un-negated numbers (a view with torch's negative bit): a byte copy would store them."""
    recorder = _Recorder()
    with Writer(recorder, "t", batch_rows=2, episode_key=None) as writer:
        writer.append({"x": torch.tensor([1.5])})
        negated = torch.tensor([2.5 + 3.0j]).conj().imag
        assert negated.is_neg() and negated.is_contiguous()
        writer.append({"x": negated})
    assert recorder.batches[0]["x"].tolist() == [[1.5], [-3.0]]
