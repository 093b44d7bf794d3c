"""The reference a composed table is checked against: a plain table of fully stored rows,
driven with the same calls, and a log of every row inserted, from which the test computes
what the composed table's readers must return (full stacks, n-step sums).

A :class:`Run` drives two tables, the composed one (any sampler x storage x compression x
frame stack x n-step) and the reference (the same sampler and seed, every row stored whole
in RAM, no readers), with one sequence of operations: inserts of interleaved actors'
steps (random sizes, episodes ending and restarting under the same id), samples,
priority updates, deletes, resets and save/load. The samplers see the same inserts, so
both tables draw the same ids with the same probabilities and weights; the composed
table's batch must then be, bit for bit, what :func:`expected_batch` builds from the
reference's rows and the log.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from replay_server.engine.config import SamplerKind, TableConfig
from replay_server.engine.samplers import SAMPLERS
from replay_server.engine.storage.backends import BACKENDS
from replay_server.engine.storage.placement import cpu_stand_in
from replay_server.engine.table import Table
from replay_server.errors import EmptyTableError, RateLimitedError

STACK = 3
FRAME = (4, 5)
GAMMA = 0.9


def storages() -> tuple[str, ...]:
    return (*BACKENDS, "device")


@dataclass(frozen=True)
class Combo:
    """One cell of the matrix."""

    sampler: str
    storage: str
    compressed: bool
    stacked: bool
    n_step: int

    @property
    def meaningful(self) -> bool:
        """n-step on a queue is the one refused here (its rows go before their returns exist)."""
        return not (self.n_step > 1 and self.kind.traits.consumes)

    @property
    def kind(self) -> SamplerKind:
        return SamplerKind(self.sampler)

    @property
    def slices(self) -> bool:
        return self.kind.traits.slices

    def __str__(self) -> str:
        return (f"{self.sampler}-{self.storage}{'-lz4' if self.compressed else ''}"
                f"{'-stack' if self.stacked else ''}-n{self.n_step}")

    def configs(self, directory: Path, capacity: int, seed: int) -> tuple[TableConfig, TableConfig]:
        """The composed table's config and the reference's."""
        common = {"name": "t", "capacity": capacity, "sampler": self.sampler, "seed": seed,
                  "slice_len": 3 if self.slices else None, "gamma": GAMMA}
        options: dict = {"n_step": self.n_step}
        if self.storage == "memmap":
            options.update(storage="memmap", storage_dir=str(directory))
        elif self.storage == "device":
            options["device"] = "cuda"
        elif self.storage != "memory":
            options["storage"] = self.storage
        if self.compressed:
            options["compress_keys"] = ["obs", "next.obs", "reward"]
        if self.stacked:
            options["frame_stack_key"] = "obs"
        return TableConfig(**common, **options), TableConfig(**common)


def every_combo() -> list[Combo]:
    """Every meaningful cell, over every sampler and storage registered now (a test's own
    included; ``device``: memory columns on a device)."""
    return [combo for sampler in SAMPLERS for storage in storages() for compressed in (False, True)
            for stacked in (False, True) for n_step in (1, 3)
            if (combo := Combo(sampler, storage, compressed, stacked, n_step)).meaningful]


class Actors:
    """Environments stepping episodes, stacking frames as a wrapper would (repeat padding)."""

    def __init__(self, count: int, rng: np.random.Generator) -> None:
        self.rng = rng
        self.count = count
        self.frames: list[list[np.ndarray]] = [[] for _ in range(count)]
        self.t = np.zeros(count, dtype=np.int64)

    def _frame(self, actor: int) -> np.ndarray:
        return self.rng.integers(0, 4, FRAME, dtype=np.uint8) * (actor + 1)  # compressible

    def steps(self, n: int) -> dict[str, torch.Tensor]:
        rows: dict[str, list] = {k: [] for k in ("obs", "next", "reward", "done", "episode",
                                                 "action")}
        for _ in range(n):
            actor = int(self.rng.integers(self.count))
            if not self.frames[actor]:
                first = self._frame(actor)
                self.frames[actor] = [first] * STACK
            obs = np.stack(self.frames[actor][-STACK:])
            following = self._frame(actor)
            done = bool(self.rng.random() < 0.15)
            rows["obs"].append(obs)
            rows["next"].append(np.concatenate([obs[1:], following[None]]))
            rows["reward"].append(np.float32(self.rng.standard_normal()))
            rows["done"].append(done)
            rows["episode"].append(actor)
            rows["action"].append(int(self.rng.integers(6)))
            self.frames[actor] = [] if done else [*self.frames[actor], following]
        return {"obs": torch.from_numpy(np.stack(rows["obs"])),
                "next": {"obs": torch.from_numpy(np.stack(rows["next"]))},
                "reward": torch.tensor(rows["reward"]), "done": torch.tensor(rows["done"]),
                "episode": torch.tensor(rows["episode"], dtype=torch.int64),
                "action": torch.tensor(rows["action"], dtype=torch.int64)}


@dataclass
class Log:
    """Every row inserted, by id, and each episode's ids in step order."""

    capacity: int
    rows: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    episode_of: dict[int, list[int]] = field(default_factory=dict)
    open: dict[int, list[int]] = field(default_factory=dict)

    def add(self, ids: torch.Tensor, data: dict) -> None:
        for i, row_id in enumerate(ids.tolist()):
            row = {"obs": data["obs"][i], "next.obs": data["next"]["obs"][i],
                   "reward": data["reward"][i], "done": data["done"][i],
                   "episode": data["episode"][i], "action": data["action"][i]}
            self.rows[row_id] = row
            actor = int(row["episode"])
            episode = self.open.setdefault(actor, [])
            episode.append(row_id)
            self.episode_of[row_id] = episode
            if bool(row["done"]):
                del self.open[actor]

    def forget_open(self) -> None:
        """A reset: episodes running go on in new rows, unlinked from the old (as the table)."""
        self.open.clear()

    def n_step(self, row_id: int, n: int) -> tuple[list[int], float]:
        """The ids of the n-step window from ``row_id`` and its discounted reward sum."""
        episode = self.episode_of[row_id]
        start = episode.index(row_id)
        window = episode[start:start + n]
        total = 0.0
        for k, step in enumerate(window):
            total += GAMMA ** k * float(self.rows[step]["reward"])
        return window, total


def expected_batch(reference, log: Log, combo: Combo) -> dict[str, torch.Tensor]:
    """What the composed table must return for the reference's batch (same ids)."""
    columns = {key: value for key, value in reference.columns.items()}
    if combo.n_step == 1:
        return columns
    ids = reference.ids.reshape(-1).tolist()
    reward = torch.empty(len(ids), dtype=torch.float32)
    steps = torch.empty(len(ids), dtype=torch.int64)
    tail = {key: [] for key in ("next.obs", "done")}
    for i, row_id in enumerate(ids):
        window, total = log.n_step(row_id, combo.n_step)
        reward[i] = torch.tensor(total, dtype=torch.float64).to(torch.float32)
        steps[i] = len(window)
        last = log.rows[window[-1]]
        for key in tail:
            tail[key].append(last[key])
    shape = reference.ids.shape
    columns["reward"] = reward.view(shape)
    columns["steps_to_next_obs"] = steps.view(shape)
    for key, values in tail.items():
        columns[key] = torch.stack(values).view(*shape, *values[0].shape)
    return columns


def same(batch, reference, log: Log, combo: Combo) -> None:
    assert torch.equal(batch.ids, reference.ids)
    assert torch.equal(batch.probabilities, reference.probabilities)
    assert torch.equal(batch.weights, reference.weights)
    expected = expected_batch(reference, log, combo)
    assert sorted(batch.columns) == sorted(expected), (sorted(batch.columns), sorted(expected))
    for key, value in expected.items():
        got = batch.columns[key]
        assert got.dtype == value.dtype and torch.equal(got.cpu(), value), (str(combo), key)


class Run:
    """Drives the composed and the reference table through one random sequence of calls."""

    def __init__(self, combo: Combo, directory: Path, *, capacity: int = 23, seed: int = 0
                 ) -> None:
        self.combo = combo
        self.rng = np.random.default_rng(seed)
        self.actors = Actors(3, self.rng)
        self.log = Log(capacity)
        self.stand_in = cpu_stand_in() if combo.storage == "device" else contextlib.nullcontext()
        self.stand_in.__enter__()
        self.config, self.reference_config = combo.configs(directory, capacity, seed)
        self.table, self.reference = Table(self.config), Table(self.reference_config)
        self.checked = 0

    def close(self) -> None:
        self.stand_in.__exit__(None, None, None)

    def insert(self, n: int) -> None:
        data = self.actors.steps(n)
        priorities = (torch.from_numpy(self.rng.random(n) * 3)
                      if self.combo.kind.is_prioritized and self.rng.random() < 0.5 else None)
        ids = self.table.insert(data, priorities)
        assert torch.equal(ids, self.reference.insert(data, priorities))
        self.log.add(ids, data)

    def sample(self, batch_size: int) -> None:
        outcomes = []
        for table in (self.table, self.reference):
            try:
                outcomes.append(table.sample(batch_size))
            except (EmptyTableError, RateLimitedError) as exc:
                outcomes.append(type(exc))
        batch, reference = outcomes
        if isinstance(reference, type):
            assert batch is reference, (str(self.combo), batch, reference)
            return
        same(batch, reference, self.log, self.combo)
        self.checked += 1
        if self.combo.kind.is_prioritized:
            ids = reference.ids if reference.ids.dim() == 1 else reference.ids[:, 0]
            new = torch.from_numpy(self.rng.random(ids.numel()) * 2)
            assert self.table.update_priorities(ids, new) == \
                self.reference.update_priorities(ids, new)

    def delete(self) -> None:
        if not self.combo.kind.traits.consumes or not self.log.rows:
            return
        known = sorted(self.log.rows)[-self.log.capacity:]
        chosen = torch.tensor(self.rng.choice(known, size=min(2, len(known)), replace=False),
                              dtype=torch.int64)
        assert self.table.delete(chosen) == self.reference.delete(chosen)

    def reload(self) -> None:
        """Save both tables and load them into fresh ones (a checkpoint and restore)."""
        for name in ("table", "reference"):
            table = getattr(self, name)
            restored = Table(table.config)
            restored.load_state_dict(table.state_dict())
            setattr(self, name, restored)  # stored rows keep their ids; new ones get new

    def reset(self) -> None:
        self.table.reset()
        self.reference.reset()
        self.log.forget_open()

    def play(self, steps: int) -> None:
        """A random sequence of ``steps`` operations."""
        for _ in range(steps):
            roll = self.rng.random()
            if roll < 0.45:
                self.insert(int(self.rng.integers(1, 9)))
            elif roll < 0.9:
                self.sample(int(self.rng.integers(1, 6)))
            elif roll < 0.95:
                self.delete()
            elif roll < 0.98:
                self.reload()
            else:
                self.reset()
