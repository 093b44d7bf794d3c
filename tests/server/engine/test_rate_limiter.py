"""replay_server.engine.rate_limiter: Reverb's rules, whole-call admission, counters and state.

Scripts of operations with hand-computed outcomes pin the rules; a hypothesis
model check compares ``can_insert``/``can_sample`` with a plain transcription
of Reverb's ``CanInsert``/``CanSample`` and checks that first-row admission
never deadlocks and keeps the count within one call of the window.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replay_server.engine.config import TableConfig
from replay_server.errors import RateLimitedError
from replay_server.engine.rate_limiter import RateLimiter

# ------------------------------------------------------------- the scripts

# Each step: (operation, rows, expected). "insert"/"sample" expect whether the
# call is admitted (then it is recorded); "can_insert"/"can_sample" expect the
# rule's answer for that many rows; "delete"/"reset" just happen.
SCRIPTS: dict[str, tuple[tuple[int, float | None, float | None], list[tuple[str, int, bool]]]] = {
    "min-size-blocks-samples-until-reached": ((2, None, None), [
        ("sample", 1, False), ("insert", 1, True), ("sample", 1, False),
        ("insert", 1, True), ("sample", 5, True),
        ("insert", 10**6, True), ("can_insert", 10**9, True),  # MinSize never holds inserts
    ]),
    # spi=1.5, min_size=1, error_buffer=3: window [1.5 - 3, 1.5 + 3] = [-1.5, 4.5].
    "operations-within-the-window-pass": ((1, 1.5, 3.0), [
        ("can_insert", 1, True), ("insert", 1, True),            # filling up; count 1.5
        ("can_insert", 1, True), ("can_insert", 2, True),        # 3.0, 4.5
        ("can_insert", 3, False),                                # 6.0 > 4.5
        ("insert", 2, True),                                     # count 4.5
        ("can_insert", 1, False), ("insert", 1, False),          # 6.0 > 4.5: waits
        ("can_sample", 1, True), ("can_sample", 6, True),        # 3.5, -1.5
        ("can_sample", 7, False),                                # -2.5 < -1.5
        ("sample", 6, True),                                     # count -1.5
        ("sample", 1, False), ("can_insert", 1, True),           # 6.0 - 6 = 0 <= 4.5
    ]),
    # A whole call goes in when its first row fits: the count overshoots by the call.
    "a-call-is-admitted-by-its-first-row": ((1, 1.0, 2.0), [  # window [-1, 3]
        ("insert", 1, True),                                     # count 1
        ("can_sample", 100, False), ("sample", 100, True),       # first row: 0 >= -1; count -99
        ("sample", 1, False),
        ("insert", 50, True), ("insert", 50, True),              # count 1
        ("sample", 1, True),
    ]),
    # spi=5, min_size=2, error_buffer=5: window [5, 15] (Reverb's delete tests).
    "deletes-below-min-size-free-inserts-and-hold-samples": ((2, 5.0, 5.0), [
        ("insert", 1, True), ("insert", 1, True),                # count 10
        ("insert", 1, True),                                     # 15 <= 15
        ("insert", 1, False),                                    # 20 > 15
        ("sample", 1, True),                                     # 14 >= 5
        ("insert", 1, False),                                    # 19 > 15
        ("delete", 2, True),                                     # size 1 < min size
        ("can_insert", 1, True), ("sample", 1, False),
        ("insert", 1, True), ("sample", 1, True),
    ]),
    "reset-zeroes-the-counters": ((2, 2.0, 2.0), [              # window [2, 6]
        ("insert", 3, True), ("sample", 1, True), ("reset", 0, True),
        ("sample", 1, False), ("can_insert", 2, True), ("can_insert", 3, True),
        ("can_insert", 4, False),
    ]),
    "no-limiter-admits-everything": ((0, None, None), [
        ("sample", 1, True), ("insert", 10**6, True), ("sample", 10**7, True),
    ]),
}


def run_script(limiter: RateLimiter, steps: list[tuple[str, int, bool]]) -> None:
    for number, (operation, rows, expected) in enumerate(steps):
        where = f"step {number}: {operation}({rows}) {limiter.describe()}"
        if operation in ("can_insert", "can_sample"):
            assert getattr(limiter, operation)(rows) is expected, where
        elif operation in ("insert", "sample"):
            before = limiter.state_dict()
            try:
                getattr(limiter, f"check_{operation}")(rows, "t")
            except RateLimitedError:
                assert not expected, where
                assert limiter.state_dict() == before, where
            else:
                assert expected, where
                (limiter.inserted if operation == "insert" else limiter.sampled)(rows)
        elif operation == "delete":
            limiter.deleted(rows)
        else:
            limiter.reset()


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_script(name: str) -> None:
    (min_size, spi, buffer), steps = SCRIPTS[name]
    run_script(RateLimiter(min_size, spi, buffer), steps)


def test_held_back_call_raises_rate_limited_error_naming_the_state() -> None:
    limiter = RateLimiter(3, 2.0, 4.0)
    limiter.inserted(1)
    with pytest.raises(RateLimitedError) as info:
        limiter.check_sample(8, "replay")
    error = info.value
    assert (error.table, error.operation, error.count) == ("replay", "sample", 8)
    assert str(error) == (
        "table 'replay': sample of 8 rows blocked by the rate limiter (inserts=1, samples=0, "
        "deletes=0, size=1, min_size_to_sample=3, samples_per_insert=2, error_buffer=4)"
    )


def test_window_comes_from_error_buffer_around_the_minimum_size() -> None:
    limiter = RateLimiter(100, 8.0, 50.0)
    assert (limiter.min_diff, limiter.max_diff) == (750.0, 850.0)
    assert (RateLimiter(5).min_diff, RateLimiter(5).max_diff) == (float("-inf"), float("inf"))


def test_from_config_resolves_the_defaults() -> None:
    def limiter(**fields) -> RateLimiter:
        return RateLimiter.from_config(TableConfig(name="t", capacity=10_000, **fields))

    assert not limiter().enabled
    assert limiter(min_size_to_sample=7).min_size_to_sample == 7
    assert limiter().min_size_to_sample == 0
    ratio = limiter(samples_per_insert=4.0)
    assert (ratio.enabled, ratio.min_size_to_sample, ratio.error_buffer) == (True, 1, 4.0 * 1000)
    ratio = limiter(samples_per_insert=0.5, min_size_to_sample=2000)
    assert ratio.error_buffer == 1.0 * 2000
    assert limiter(samples_per_insert=2.0, error_buffer=3.0).error_buffer == 3.0


def test_info_reports_settings_counters_and_decisions() -> None:
    limiter = RateLimiter(2, 1.0, 2.0)
    limiter.inserted(2)
    limiter.sampled(1)
    limiter.deleted(1)
    info = limiter.info()
    assert (info.enabled, info.min_size_to_sample, info.samples_per_insert, info.error_buffer,
            info.min_diff, info.max_diff) == (True, 2, 1.0, 2.0, 0.0, 4.0)
    assert (info.inserts, info.samples, info.deletes) == (2, 1, 1)
    assert (info.can_insert, info.can_sample) == (True, False)  # size 1 < min size 2


def test_state_round_trip_restores_the_counters() -> None:
    limiter = RateLimiter(2, 1.5, 3.0)
    limiter.inserted(5)
    limiter.sampled(4)
    limiter.deleted(2)
    restored = RateLimiter(2, 1.5, 3.0)
    restored.load_state_dict(limiter.state_dict(), size=3)
    assert restored.state_dict() == {"inserts": 5, "samples": 4, "deletes": 2}


@pytest.mark.parametrize("state", [
    {"inserts": 5, "samples": 0, "deletes": 1},   # 4 rows, table holds 3
    {"inserts": 3, "samples": -1, "deletes": 0},
])
def test_state_that_does_not_fit_the_table_is_refused(state: dict) -> None:
    limiter = RateLimiter(1)
    with pytest.raises(ValueError, match="rate limiter counters"):
        limiter.load_state_dict(state, size=3)
    assert limiter.state_dict() == {"inserts": 0, "samples": 0, "deletes": 0}


def test_state_saved_without_a_limiter_counts_the_rows_present_as_inserted() -> None:
    limiter = RateLimiter(1, 2.0, 2.0)
    limiter.load_state_dict(None, size=7)
    assert limiter.state_dict() == {"inserts": 7, "samples": 0, "deletes": 0}


# ------------------------------------------------------- the model check


@dataclass
class Reference:
    """Reverb's RateLimiter (rate_limiter.cc, rate_limiters.py) transcribed plainly."""

    min_size: int
    spi: float | None
    buffer: float | None
    inserts: int = 0
    samples: int = 0
    deletes: int = 0

    def bounds(self) -> tuple[float, float, float]:
        if self.spi is None:  # MinSize: samples_per_insert=1, min/max_diff=-/+DBL_MAX
            return 1.0, -sys.float_info.max, sys.float_info.max
        offset = self.spi * self.min_size
        return self.spi, offset - self.buffer, offset + self.buffer

    def can_insert(self, n: int) -> bool:
        spi, _, max_diff = self.bounds()
        if self.inserts + n - self.deletes <= self.min_size:
            return True
        return (n + self.inserts) * spi - self.samples <= max_diff

    def can_sample(self, n: int) -> bool:
        spi, min_diff, _ = self.bounds()
        if self.inserts - self.deletes < self.min_size:
            return False
        return self.inserts * spi - self.samples - n >= min_diff


@st.composite
def limiter_settings(draw: st.DrawFn) -> tuple[int, float | None, float | None]:
    min_size = draw(st.integers(0, 30))
    if min_size and draw(st.booleans()):
        return min_size, None, None  # MinSize
    spi = draw(st.sampled_from([0.25, 0.5, 1.0, 1.5, 2.0, 4.0, 8.0]))
    buffer = max(1.0, spi) * draw(st.sampled_from([1.0, 1.5, 3.0, 10.0]))
    return max(min_size, 1), spi, buffer


OPERATIONS = st.lists(
    st.tuples(st.sampled_from(["insert", "sample", "delete", "reset"]), st.integers(1, 40)),
    max_size=60,
)


@settings(max_examples=300, deadline=None, database=None)
@given(config=limiter_settings(), operations=OPERATIONS, probes=st.lists(st.integers(1, 80),
                                                                          min_size=1, max_size=5))
def test_rules_match_reverb_and_calls_go_by_their_first_row(config, operations, probes) -> None:
    limiter, reference = RateLimiter(*config), Reference(*config)
    for operation, rows in operations:
        for n in probes:
            assert limiter.can_insert(n) is reference.can_insert(n), (operation, n)
            assert limiter.can_sample(n) is reference.can_sample(n), (operation, n)
        if operation == "reset":
            limiter.reset()
            reference.inserts = reference.samples = reference.deletes = 0
            continue
        if operation == "delete":
            rows = min(rows, reference.inserts - reference.deletes)
            limiter.deleted(rows)
            reference.deletes += rows
            continue
        admitted = (reference.can_insert if operation == "insert" else reference.can_sample)(1)
        check = limiter.check_insert if operation == "insert" else limiter.check_sample
        try:
            check(rows, "t")
        except RateLimitedError:
            assert not admitted
        else:
            assert admitted
            if operation == "insert":
                limiter.inserted(rows)
                reference.inserts += rows
            else:
                limiter.sampled(rows)
                reference.samples += rows
        assert limiter.state_dict() == {"inserts": reference.inserts,
                                        "samples": reference.samples,
                                        "deletes": reference.deletes}


@settings(max_examples=300, deadline=None, database=None)
@given(config=limiter_settings(), inserts=st.lists(st.integers(1, 40), min_size=1, max_size=4),
       samples=st.lists(st.integers(1, 200), min_size=1, max_size=4),
       order=st.lists(st.booleans(), min_size=1, max_size=300))
def test_first_row_admission_never_deadlocks_and_stays_within_one_call_of_the_window(
    config, inserts, samples, order
) -> None:
    """Actors insert and a learner samples (sizes drawn from fixed sets), each call made
    when admitted: some call can always go, and once filled up the count stays within
    ``[min_diff - (largest sample - 1), max_diff + (largest insert - 1) * spi]`` (the
    lower bound from the first sample on: before it the count only grows)."""
    min_size, spi, buffer = config
    limiter = RateLimiter(min_size, spi, buffer)
    rate = spi or 1.0
    sampled = False
    for step, prefer_insert in enumerate(order):
        n, b = inserts[step % len(inserts)], samples[step % len(samples)]
        can_insert, can_sample = limiter.can_insert(1), limiter.can_sample(1)
        assert can_insert or can_sample, limiter.describe()
        if can_insert and (prefer_insert or not can_sample):
            limiter.inserted(n)
        else:
            limiter.sampled(b)
            sampled = True
        count = limiter.inserts * rate - limiter.samples
        if sampled:
            assert count >= limiter.min_diff - (max(samples) - 1), limiter.describe()
        assert count <= limiter.max_diff + (max(inserts) - 1) * rate, limiter.describe()
