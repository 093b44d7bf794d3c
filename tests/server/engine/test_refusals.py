"""What remains refused: three combinations, each because it has no meaning, each one sentence.

Every pair of features a table can have is configured; exactly the pairs below are
refused, with the message that says why. Everything else composes (the combination
matrix, ``test_composition.py``, checks that it also works).
"""

from __future__ import annotations

from itertools import combinations

import pytest

from replay_server.engine.config import SamplerKind, TableConfig
from replay_server.errors import ConfigError

SAMPLERS = {kind.value for kind in SamplerKind}  # every registered sampler

FEATURES: dict[str, dict] = {
    **{kind.value: {"sampler": kind.value, **({"slice_len": 2} if kind.traits.slices else {})}
       for kind in SamplerKind},
    "memmap": {"storage": "memmap", "storage_dir": "/tmp"},
    "mixed storage": {"storage": "memmap", "storage_dir": "/tmp",
                      "column_storage": {"action": "memory"}},
    "device": {"device": "cuda"},
    "lz4": {"compress_keys": ["obs"]},
    "frame stack": {"frame_stack_key": "obs"},
    "n-step": {"n_step": 3},
    "max_times_sampled": {"max_times_sampled": 2},
    "max_size": {"max_times_sampled": 1, "max_size": 4},
    "rate limiter": {"min_size_to_sample": 2, "samples_per_insert": 1.5},
    "pin_memory": {"pin_memory": True},
}

REFUSED = {
    frozenset({"fifo", "n-step"}): "n_step=3 has no meaning with sampler 'fifo', which hands a "
                                   "row out as soon as it arrives, before the later steps its "
                                   "n-step return sums exist",
    frozenset({"lifo", "n-step"}): "n_step=3 has no meaning with sampler 'lifo'",
    frozenset({"memmap", "pin_memory"}): "pin_memory has no meaning with storage 'memmap', whose "
                                         "rows are file pages that pinning would hold in RAM",
    frozenset({"fifo", "rate limiter"}): "samples_per_insert=1.5 has no meaning with sampler "
                                         "'fifo' (each row handed out once), which lets a row be "
                                         "sampled at most 1 time, so inserts would wait for "
                                         "samples that wait for inserts",
    frozenset({"lifo", "rate limiter"}): "samples_per_insert=1.5 has no meaning with sampler "
                                         "'lifo'",
    frozenset({"max_size", "rate limiter"}): "samples_per_insert=1.5 has no meaning with "
                                             "max_times_sampled=1",
}
"""The three rules: n-step on a queue, pinning file pages, a ratio the remover cannot give."""

PAIRS = [pair for pair in combinations(FEATURES, 2) if len(set(pair) & SAMPLERS) < 2
         and {"max_times_sampled", "max_size"} != set(pair)]


@pytest.mark.parametrize("pair", PAIRS, ids=" + ".join)
def test_only_combinations_without_meaning_are_refused_and_say_why(pair: tuple[str, str]) -> None:
    options = {**FEATURES[pair[0]], **FEATURES[pair[1]]}
    expected = REFUSED.get(frozenset(pair))
    if expected is None:
        TableConfig(name="t", capacity=100, **options)
        return
    with pytest.raises(ConfigError) as refused:
        TableConfig(name="t", capacity=100, **options)
    message = str(refused.value)
    assert message.startswith(f"table 't': {expected}"), message
    assert message.count(";") == 1  # one sentence of why, then what to do instead


def test_there_are_three_rules() -> None:
    rules = {message.split(" has no meaning")[0].split("=")[0] for message in REFUSED.values()}
    assert rules == {"n_step", "pin_memory", "samples_per_insert"}
