"""Frame-stack dedup against the reference: the same table storing the full stacks.

Actors interleave steps in inserts of random sizes; episodes end and restart
under the same id; some actors pad their first stacks otherwise than the
table's fill rule; the ring wraps many times; tables are saved and reloaded.
Every batch must equal, bit for bit, the one the plain table returns.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replay_server.engine.config import TableConfig
from replay_server.engine.table_memory import table_bytes
from replay_server.engine.schema import FieldSpec, Schema
from replay_server.engine.storage import compressed
from replay_server.engine.table import Table
from replay_server.errors import ConfigError, InvalidArgumentError, SchemaMismatchError
from tests.server.engine.storage.counting_decoder import CountingDecoder

CAPACITY = 12


class Actor:
    """One environment stepping an episode, stacking frames as a wrapper would."""

    def __init__(self, number: int, stack: int, padding: str) -> None:
        self.number, self.stack, self.padding = number, stack, padding
        self.frames: list[torch.Tensor] = []
        self.t = 0

    def step(self, done: bool) -> dict:
        frame = torch.full((2, 3), (self.number * 50 + self.t) % 256, dtype=torch.uint8)
        frame[0, 0] = self.number
        self.t += 1
        if not self.frames:
            pad = frame if self.padding == "repeat" else torch.zeros_like(frame)
            self.frames = [pad] * (self.stack - 1)
        self.frames.append(frame)
        obs = torch.stack(self.frames[-self.stack:])
        following = torch.full((2, 3), 255 - self.t % 200, dtype=torch.uint8)
        row = {"obs": obs, "next": {"obs": torch.cat([obs[1:], following[None]])},
               "reward": torch.tensor(float(self.t)), "done": torch.tensor(done),
               "episode": torch.tensor(self.number)}
        if done:
            self.frames = []
        return row


def stacked(rows: list[dict]) -> dict:
    return {"obs": torch.stack([r["obs"] for r in rows]),
            "next": {"obs": torch.stack([r["next"]["obs"] for r in rows])},
            "reward": torch.stack([r["reward"] for r in rows]),
            "done": torch.stack([r["done"] for r in rows]),
            "episode": torch.stack([r["episode"] for r in rows])}


def same(a, b) -> None:
    assert torch.equal(a.ids, b.ids)
    for key in ("obs", "reward", "done", "episode"):
        assert torch.equal(a.data[key], b.data[key]), key
    assert torch.equal(a.data["next"]["obs"], b.data["next"]["obs"])


@settings(max_examples=50, deadline=None)
@given(plan=st.lists(st.tuples(st.integers(0, 2), st.booleans(), st.integers(1, 5),
                               st.integers(0, 12)), min_size=1, max_size=30),
       stack=st.integers(2, 4), fill=st.sampled_from(["repeat", "zero"]),
       paddings=st.lists(st.sampled_from(["repeat", "zero"]), min_size=3, max_size=3),
       n_step=st.sampled_from([1, 3]))
def test_batches_are_bit_identical_to_the_full_stack_table(plan, stack, fill, paddings,
                                                           n_step) -> None:
    """With ``n_step = 3`` the reference is the n-step table of full stacks: ``next.obs`` is
    then read at each transition's last step, without ``obs`` (its own read path)."""
    common = {"name": "t", "capacity": CAPACITY, "seed": 11, "sampler": "prioritized",
              "n_step": n_step, "gamma": 0.5}
    plain = Table(TableConfig(**common))
    config = TableConfig(**common, frame_stack_key="obs", frame_stack_fill=fill)
    dedup = Table(config)
    actors = [Actor(n, stack, paddings[n]) for n in range(3)]
    for first, ends, size, reload in plan:
        rows = [actors[(first + i) % 3].step(ends and i == size - 1) for i in range(size)]
        ids = plain.insert(stacked(rows))
        assert torch.equal(dedup.insert(stacked(rows)), ids)
        if reload == 0:  # both saved and loaded
            dedup, saved = Table(config), dedup
            dedup.load_state_dict(saved.state_dict())
            plain, saved = Table(plain.config), plain
            plain.load_state_dict(saved.state_dict())
        a, b = plain.sample(10), dedup.sample(10)
        same(a, b)


def test_a_frame_stacked_row_takes_a_quarter_of_the_memory() -> None:
    schema = Schema({"obs": FieldSpec(torch.uint8, (4, 84, 84)),
                     "next.obs": FieldSpec(torch.uint8, (4, 84, 84)),
                     "action": FieldSpec(torch.int64, ()), "reward": FieldSpec(torch.float32, ()),
                     "done": FieldSpec(torch.bool, ()), "episode": FieldSpec(torch.int64, ())})
    config = TableConfig(name="t", capacity=10, frame_stack_key="obs")
    links = 10 * 16  # the previous and next step of each slot
    assert table_bytes(config, schema) == 10 * (2 * 84 * 84 + 8 + 4 + 1 + 8) + links
    assert 10 * schema.row_bytes / table_bytes(config, schema) > 3.9


def test_an_insert_whose_next_obs_is_not_obs_shifted_is_refused_and_stores_nothing() -> None:
    table = Table(TableConfig(name="t", capacity=8, frame_stack_key="obs"))
    row = stacked([Actor(0, 4, "repeat").step(False)])
    row["next"]["obs"][0, 0] += 1
    with pytest.raises(InvalidArgumentError, match=r"row 0 has next.obs\[:-1\] != obs\[1:\]"):
        table.insert(row)
    assert table.size == 0


def test_a_schema_without_the_stacked_key_is_refused_naming_it() -> None:
    table = Table(TableConfig(name="t", capacity=8, frame_stack_key="pixels"))
    row = stacked([Actor(0, 4, "repeat").step(False)])
    with pytest.raises(SchemaMismatchError, match="needs key 'pixels'"):
        table.insert(row)


def test_rows_without_next_obs_stack_obs_alone() -> None:
    """Sequences (R2D2) need no next observation: each step's obs is stacked from the frames."""
    common = {"name": "t", "capacity": 16, "seed": 1}
    plain, dedup = Table(TableConfig(**common)), Table(TableConfig(**common, frame_stack_key="obs"))
    actor = Actor(0, 4, "repeat")
    rows = stacked([actor.step(i == 9) for i in range(10)])
    del rows["next"]
    for table in (plain, dedup):
        table.insert(rows)
    a, b = plain.sample(16), dedup.sample(16)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.data["obs"], b.data["obs"])
    assert "next" not in b.data
    assert dedup.info().storage_bytes < 0.6 * plain.info().storage_bytes


@pytest.mark.parametrize("fields, named", [
    ({"frame_stack_key": "next.obs"}, "must name the stacked observation"),
    ({"frame_stack_fill": "edge"}, "frame_stack_fill must be"),
])
def test_bad_frame_stack_options_are_refused(fields: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        TableConfig(name="t", capacity=8, **fields)


def frame_of(step: torch.Tensor, actor: torch.Tensor) -> torch.Tensor:
    """One value per frame (each [84, 84] frame is filled with it)."""
    return ((step * 7 + actor * 50) % 251).to(torch.uint8)


def atari_rows(first: int, n: int, actors: int = 3) -> dict:
    """``n`` interleaved Atari steps ([4, 84, 84] uint8, repeat-padded stacks) from ``first`` on."""
    t = torch.arange(first, first + n)
    step, actor = t // actors, t % actors
    obs = torch.empty((n, 4, 84, 84), dtype=torch.uint8)
    for k in range(4):  # frame of step s - (3 - k), the first repeated before the start
        obs[:, k] = frame_of(torch.clamp(step - (3 - k), min=0), actor)[:, None, None]
    following = obs.roll(-1, dims=1)
    following[:, -1] = frame_of(step + 1, actor)[:, None, None]
    return {"obs": obs, "next": {"obs": following}, "reward": t.float(),
            "done": torch.zeros(n, dtype=torch.bool), "episode": actor}


def test_batches_large_enough_to_split_across_workers_are_those_of_the_full_stack_table() -> None:
    common = {"name": "t", "capacity": 96, "seed": 4}
    plain, dedup = Table(TableConfig(**common)), Table(TableConfig(**common, frame_stack_key="obs"))
    for first in (0, 60, 120):  # the ring wraps: kept histories too
        for table in (plain, dedup):
            table.insert(atari_rows(first, 60))
    assert dedup.info().sampler_stats["frame_history_rows"] > 0
    out = {key: torch.full(shape, 7, dtype=dtype)
           for key, (dtype, shape) in dedup.batch_layout(160).items()}
    # 160 stacks of 4 frames of 84x84: 4.5 MB, split across the worker pool
    a, b, c = plain.sample(160), dedup.sample(160), dedup.sample(160, out=out)
    d = plain.sample(160)
    same(a, b)
    same(d, c)
    assert c.data["obs"].data_ptr() == out["obs"].data_ptr()
    assert c.data["next"]["obs"].data_ptr() == out["next.obs"].data_ptr()


def noise_rows(first: int, n: int, actors: int = 3) -> dict:
    """Like :func:`atari_rows` in episodes of 7 steps, every frame its own noise ([32, 32]: a stored lz4 block each,
    no two alike), steps ``first, ...`` of ``actors`` interleaved actors."""
    t = torch.arange(first, first + n)
    step, actor = t // actors, t % actors

    def frame(s: torch.Tensor) -> torch.Tensor:
        return torch.stack([torch.randint(0, 256, (32, 32), dtype=torch.uint8,
                                          generator=torch.Generator().manual_seed(int(k)))
                            for k in s * actors + actor])

    start = step // 7 * 7  # episodes of 7 steps, stacks padded with their first frame
    obs = torch.stack([frame(torch.maximum(step - (3 - k), start)) for k in range(4)], dim=1)
    following = torch.cat([obs[:, 1:], frame(step + 1)[:, None]], dim=1)
    return {"obs": obs, "next": {"obs": following}, "reward": t.float(),
            "done": (step % 7 == 6), "episode": actor * 100 + step // 7}


def test_an_nstep_batch_over_lz4_frames_decodes_each_distinct_frame_once(monkeypatch) -> None:
    """The Ape-X read: ``obs`` at each transition's first step and ``next.obs`` at its last
    share frames (and a batch of 96 from 45 rows repeats rows): the batch equals the plain
    n-step table's, and each stored frame it needs reached the decoder once."""
    counting = CountingDecoder(32 * 32)
    monkeypatch.setattr(compressed, "DECODER", counting)
    common = {"name": "t", "capacity": 48, "seed": 5, "sampler": "prioritized", "n_step": 3,
              "gamma": 0.5}
    plain = Table(TableConfig(**common))
    apex = Table(TableConfig(**common, frame_stack_key="obs", compress_keys=["obs", "next.obs"]))
    for first in (0, 20):
        rows = noise_rows(first, 20 if first == 0 else 25)
        assert torch.equal(plain.insert(rows), apex.insert(rows))
    assert apex.info().sampler_stats["frame_history_rows"] == 0  # every frame is decoded
    counting.blocks.clear()
    expected, got = plain.sample(96), apex.sample(96)
    same(expected, got)
    stacks, following = expected.data["obs"], expected.data["next"]["obs"]
    frames = {f.numpy().tobytes() for f in torch.cat([stacks, following[:, :-1]], 1).flatten(0, 1)}
    newest = {f.numpy().tobytes() for f in following[:, -1]}
    assert len(counting.blocks) == len(frames) + len(newest) < 96 * 8 // 2
    # a frame stored in both columns (step t + 1's, and step t's next) is one block in each
    assert len(set(counting.blocks)) == len(frames | newest)
