"""The two flagship configs, Ape-X and R2D2 on Atari (deploy/configs/), through a real server.

Each test starts ``replay-server serve`` with the shipped config file, changed only in
its sizes (capacity, the learner's minimum) and paths (storage, checkpoints), then
plays the actors' and the learner's parts over loopback with the real client:
Atari-shaped episodes from several actors, interleaved; batches checked against what
the actors sent (stacks rebuilt from one stored frame per step, n-step sums, 80-step
slices), priority updates (R2D2: max/mean mixed per slice), a checkpoint, a restart
and the same rows again.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from replay_client import ReplayClient
from tests.conftest import start_server

CONFIGS = Path(__file__).resolve().parents[2] / "deploy" / "configs"
STACK, SIDE = 4, 84


def small(name: str, tmp_path: Path, capacity: int) -> str:
    """The shipped config ``name``, with a test's sizes and paths."""
    text = (CONFIGS / name).read_text()
    (tmp_path / "files").mkdir(exist_ok=True)
    text = re.sub(r"(?m)^capacity = .*$", f"capacity = {capacity}", text)
    text = re.sub(r"(?m)^min_size_to_sample = .*$", "min_size_to_sample = 64", text)
    text = re.sub(r'(?m)^storage_dir = .*$', f'storage_dir = "{tmp_path / "files"}"', text)
    text = re.sub(r'(?m)^checkpoint_dir = .*$', f'checkpoint_dir = "{tmp_path / "ckpt"}"', text)
    return re.sub(r'(?m)^address = .*$', "", text)


class Atari:
    """Actors playing episodes of 84x84 screens (a few moving blocks: they compress as
    screens do), stacking 4 frames with the first one repeated, as Atari wrappers do."""

    def __init__(self, actors: int, seed: int, episode_end: float) -> None:
        self.rng = np.random.default_rng(seed)
        self.episode_end = episode_end
        self.frames: list[list[np.ndarray]] = [[] for _ in range(actors)]
        self.episode = list(range(actors))
        self.next_episode = actors
        self.sent: dict[int, dict[str, torch.Tensor]] = {}  # id -> the row as sent

    def _screen(self) -> np.ndarray:
        screen = np.zeros((SIDE, SIDE), dtype=np.uint8)
        for _ in range(3):
            y, x = self.rng.integers(0, SIDE - 8, 2)
            screen[y:y + 8, x:x + 8] = self.rng.integers(50, 255)
        return screen

    def steps(self, n: int, with_next: bool) -> dict[str, torch.Tensor]:
        rows: dict[str, list] = {k: [] for k in ("obs", "next", "action", "reward", "done",
                                                 "episode")}
        for _ in range(n):
            actor = int(self.rng.integers(len(self.frames)))
            if not self.frames[actor]:
                self.frames[actor] = [self._screen()] * STACK
            obs = np.stack(self.frames[actor][-STACK:])
            screen = self._screen()
            done = bool(self.rng.random() < self.episode_end)
            rows["obs"].append(obs)
            rows["next"].append(np.concatenate([obs[1:], screen[None]]))
            rows["action"].append(int(self.rng.integers(18)))
            rows["reward"].append(float(self.rng.integers(-1, 2)))
            rows["done"].append(done)
            rows["episode"].append(self.episode[actor])
            self.frames[actor] = [*self.frames[actor], screen]
            if done:
                self.frames[actor] = []
                self.episode[actor], self.next_episode = self.next_episode, self.next_episode + 1
        data = {"obs": torch.from_numpy(np.stack(rows["obs"])),
                "action": torch.tensor(rows["action"]),
                "reward": torch.tensor(rows["reward"], dtype=torch.float32),
                "done": torch.tensor(rows["done"]),
                "episode": torch.tensor(rows["episode"])}
        if with_next:
            data["next"] = {"obs": torch.from_numpy(np.stack(rows["next"]))}
            data["truncated"] = torch.zeros(n, dtype=torch.bool)
        return data

    def remember(self, ids: torch.Tensor, data: dict) -> None:
        for i, row_id in enumerate(ids.tolist()):
            self.sent[row_id] = {"obs": data["obs"][i], "episode": data["episode"][i],
                                 "reward": data["reward"][i], "done": data["done"][i],
                                 **({"next.obs": data["next"]["obs"][i]} if "next" in data
                                    else {})}


def test_apex_atari_config_serves_n_step_transitions_of_stacked_compressed_frames(tmp_path):
    atari = Atari(actors=4, seed=1, episode_end=0.02)
    server = start_server(tmp_path, small("apex_atari.toml", tmp_path, capacity=600))
    try:
        client = ReplayClient(server.address, timeout=60)
        for _ in range(8):  # 800 steps into 600 slots: the ring wraps
            data = atari.steps(100, with_next=True)
            atari.remember(client.insert("apex", data), data)
        info = client.info()["apex"]
        assert info.capabilities.n_step == 3 and info.capabilities.frame_stack_key == "obs"
        assert info.capabilities.priorities
        raw = 600 * 2 * STACK * SIDE * SIDE  # a plain table's obs and next.obs
        assert info.storage_bytes < raw / 8  # one frame each, compressed
        batch = client.sample("apex", 64)
        _check_apex(batch, atari)
        client.update_priorities("apex", batch.ids, torch.rand(64, dtype=torch.float64) + 0.1)
        client.checkpoint()
        before = client.sample("apex", 64)
    finally:
        assert server.stop() == 0
    server = start_server(tmp_path, small("apex_atari.toml", tmp_path, capacity=600),
                          name="restarted")
    try:
        client = ReplayClient(server.address, timeout=60)
        assert client.info()["apex"].size == 600
        _check_apex(client.sample("apex", 64), atari)
        assert before.ids.numel() == 64
    finally:
        assert server.stop() == 0


def _check_apex(batch, atari: Atari) -> None:
    """Stacks as sent; 3-step sums and bootstrap stacks from the actors' own episodes."""
    by_episode: dict[int, list[int]] = {}
    for row_id, row in atari.sent.items():
        by_episode.setdefault(int(row["episode"]), []).append(row_id)
    for i, row_id in enumerate(batch.ids.tolist()):
        sent = atari.sent[row_id]
        assert torch.equal(batch.data["obs"][i], sent["obs"])
        episode = by_episode[int(sent["episode"])]
        window = episode[episode.index(row_id):][:3]
        window = window[:next((k + 1 for k, s in enumerate(window)
                               if bool(atari.sent[s]["done"])), len(window))]
        steps = int(batch.data["steps_to_next_obs"][i])
        assert steps <= len(window) and steps >= 1
        window = window[:steps]  # shorter only at the newest step of a running episode
        expected = sum(0.99 ** k * float(atari.sent[s]["reward"]) for k, s in enumerate(window))
        assert abs(float(batch.data["reward"][i]) - expected) < 1e-5
        assert torch.equal(batch.data["next"]["obs"][i], atari.sent[window[-1]]["next.obs"])


def test_r2d2_atari_config_serves_prioritized_80_step_slices_of_stacked_frames_from_files(
        tmp_path):
    atari = Atari(actors=2, seed=2, episode_end=0.003)
    server = start_server(tmp_path, small("r2d2_atari.toml", tmp_path, capacity=700))
    try:
        client = ReplayClient(server.address, timeout=60)
        for _ in range(9):  # 900 steps into 700 slots
            data = atari.steps(100, with_next=False)
            atari.remember(client.insert("r2d2", data), data)
        info = client.info()["r2d2"]
        assert info.capabilities.slices and info.capabilities.frame_stack_key == "obs"
        batch = client.sample("r2d2", 8)
        assert batch.data["obs"].shape == (8, 80, STACK, SIDE, SIDE)
        for i, slice_ids in enumerate(batch.ids.tolist()):
            episodes = {int(atari.sent[s]["episode"]) for s in slice_ids}
            assert len(episodes) == 1  # one episode, in order
            for j, row_id in enumerate(slice_ids):
                assert torch.equal(batch.data["obs"][i, j], atari.sent[row_id]["obs"])
        td = torch.rand(8, 80, dtype=torch.float64)
        assert client.update_priorities("r2d2", batch.ids, td) == 8  # mixed into the starts
        assert list((tmp_path / "files").iterdir()) == []  # files unlinked once mapped
        client.checkpoint()
    finally:
        assert server.stop() == 0
    server = start_server(tmp_path, small("r2d2_atari.toml", tmp_path, capacity=700),
                          name="restarted")
    try:
        client = ReplayClient(server.address, timeout=60)
        batch = client.sample("r2d2", 4)
        for i, slice_ids in enumerate(batch.ids.tolist()):
            assert torch.equal(batch.data["obs"][i, -1], atari.sent[slice_ids[-1]]["obs"])
    finally:
        assert server.stop() == 0
