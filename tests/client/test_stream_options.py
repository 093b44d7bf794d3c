"""stream_options: how long a lost stream keeps trying to resume (``reconnect_s``)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from replay_client.errors import InvalidArgumentError
from replay_client.stream_options import reconnect_window, stream_options
from replay_feed.options import RECONNECT_S


@dataclass
class _Connection:
    answered: bool
    max_retry_s: float
    connect_window: float = 2.0

    def retry_window(self) -> float:
        return self.max_retry_s if self.answered else self.connect_window


def test_a_stream_outlasts_a_restart_longer_than_max_retry_s_by_default() -> None:
    """A learner's stream gave up after the client's 10 s max_retry_s while a server
    restarted by hand took longer to serve again (issue 32, friction 5)."""
    window = reconnect_window(stream_options(None, {}), _Connection(True, max_retry_s=10))
    assert window() == RECONNECT_S >= 60
    longer = reconnect_window(stream_options(None, {}), _Connection(True, max_retry_s=300))
    assert longer() == 300  # the client's own, when longer


def test_reconnect_s_is_what_the_learner_asked_for() -> None:
    options = stream_options(None, {"reconnect_s": 5})
    assert reconnect_window(options, _Connection(True, max_retry_s=30))() == 5


def test_a_server_that_never_answered_gets_the_clients_connect_window() -> None:
    connection = _Connection(False, max_retry_s=10)
    window = reconnect_window(stream_options(None, {}), connection)
    assert window() == 2.0
    connection.answered = True  # asked when the stream is lost, not when it opens
    assert window() == RECONNECT_S


@pytest.mark.parametrize("bad", [0, -1, float("inf"), "60", True])
def test_a_bad_reconnect_s_is_refused_naming_it(bad) -> None:
    with pytest.raises(InvalidArgumentError, match="reconnect_s must be a number of seconds"):
        stream_options(None, {"reconnect_s": bad})
