"""Record real Atari frames for the flagship benchmarks (benchmarks/flagship.py).

    python -m venv /tmp/ale && /tmp/ale/bin/pip install ale-py numpy
    /tmp/ale/bin/python benchmarks/atari_frames.py [--frames 20000]

ale-py ships the game ROMs in its wheel. Plays a few games with random actions (as an
actor does early in training), keeps every 4th screen (the usual frame skip) as
grayscale 84x84 uint8 (nearest-pixel resize of the 210x160 screen, as close to the
usual area resize as lz4 cares about), with each episode's start marked, and writes
``benchmarks/data/atari_frames.npz`` (git-ignored; the benchmarks fall back to
synthetic screens without it, and say so). Runs in its own virtualenv: never in the
project's, whose torch it must not touch.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

GAMES = ("pong", "breakout", "space_invaders", "seaquest", "ms_pacman")
OUT = Path(__file__).resolve().parent / "data" / "atari_frames.npz"


def main() -> None:
    from ale_py import ALEInterface, roms

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=20_000, help="frames in all")
    parser.add_argument("--max-episode", type=int, default=1_500)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows = np.linspace(0, 209, 84).astype(int)
    cols = np.linspace(0, 159, 84).astype(int)
    frames, starts, games = [], [], []
    per_game = args.frames // len(GAMES)
    for number, game in enumerate(GAMES):
        ale = ALEInterface()
        ale.setInt("random_seed", number)
        ale.loadROM(roms.get_rom_path(game))
        actions = ale.getMinimalActionSet()
        kept = 0
        while kept < per_game:
            ale.reset_game()
            starts.append(len(frames))
            for step in range(args.max_episode * 4):
                ale.act(actions[rng.integers(len(actions))])
                if step % 4 == 3:
                    frames.append(ale.getScreenGrayscale()[rows][:, cols])
                    games.append(number)
                    kept += 1
                if ale.game_over() or kept >= per_game:
                    break
    OUT.parent.mkdir(exist_ok=True)
    np.savez_compressed(OUT, frames=np.stack(frames), starts=np.array(starts),
                        games=np.array(games), names=np.array(GAMES))
    print(f"{len(frames)} frames of {len(GAMES)} games, {len(starts)} episodes -> {OUT}")


if __name__ == "__main__":
    main()
