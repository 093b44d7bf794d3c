"""The combination matrix: every meaningful sampler x storage x compression x frame stack x
n-step table, checked against a plain table of fully stored rows (see ``composition.py``).

Each cell plays a random sequence of inserts (interleaved actors, episodes ending and
restarting, the ring wrapping), samples (ids, probabilities, weights and every column bit
for bit against the reference; n-step sums computed by the test), priority updates,
deletes, resets and save/load. ``make test`` runs a covering subset (every value of every
axis, every pair of the readers with each sampler); ``make soak`` the full matrix.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replay_server.engine.samplers import SAMPLERS
from tests.server.engine.composition import Combo, Run, every_combo, storages

CORE = [
    Combo("prioritized", "memory", True, True, 3),       # Ape-X
    Combo("prioritized_slice", "memmap", True, True, 1),  # R2D2
    Combo("uniform", "device", True, True, 3),
    Combo("slice", "device", False, True, 3),
    Combo("fifo", "memmap", True, True, 1),
    Combo("lifo", "device", True, False, 1),
    Combo("uniform", "memmap", False, False, 3),
    Combo("prioritized_slice", "memory", False, False, 3),
    Combo("slice", "memory", True, False, 1),
    Combo("prioritized", "device", False, True, 1),
]


def _play(combo: Combo, directory: Path, steps: int, seed: int = 0) -> int:
    run = Run(combo, directory, seed=seed)
    try:
        run.play(steps)
        for _ in range(3):  # end with batches checked, whatever the sequence left
            run.insert(8)
            run.sample(4)
        return run.checked
    finally:
        run.close()


@pytest.mark.parametrize("combo", CORE, ids=str)
def test_a_composed_table_returns_what_the_reference_computes(combo: Combo, tmp_path: Path) -> None:
    assert _play(combo, tmp_path, 120) >= 10


@pytest.mark.slow
@pytest.mark.parametrize("combo", every_combo(), ids=str)
def test_every_meaningful_combination_returns_what_the_reference_computes(
        combo: Combo, tmp_path: Path) -> None:
    for seed in range(3):
        assert _play(combo, tmp_path, 300, seed) >= 10


def test_the_matrix_has_every_meaningful_cell() -> None:
    cells = every_combo()
    queues = sum(cls.traits.consumes for cls in SAMPLERS.values())
    kinds = len(storages())
    assert len(cells) == len(SAMPLERS) * kinds * 8 - queues * kinds * 4  # n-step on a queue
    for axis in ("sampler", "storage", "compressed", "stacked", "n_step"):
        assert {getattr(c, axis) for c in CORE} == {getattr(c, axis) for c in cells}, axis


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), steps=st.integers(10, 80),
       combo=st.sampled_from([CORE[0], CORE[1], CORE[3]]))
def test_random_sequences_agree_with_the_reference(tmp_path_factory, seed: int, steps: int,
                                                   combo: Combo) -> None:
    _play(combo, tmp_path_factory.mktemp("memmap"), steps, seed)
