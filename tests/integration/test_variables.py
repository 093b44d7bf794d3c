"""Named variables through a real server: publish/fetch, versions, newer_than waits and
timeouts, refused input, the budget, and restore after a checkpoint."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from replay_client import ReplayClient, Variable, errors
from tests.conftest import module_server, stays, wait_for

CONFIG = """
[server]
variables_max_mb = 1

[[tables]]
name = "replay"
capacity = 100
"""
JOIN_S = 30

served = module_server(CONFIG)


def policy(value: float) -> dict[str, torch.Tensor]:
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with torch.no_grad():
        for p in net.parameters():
            p.fill_(value)
    return net.state_dict()


def test_publish_then_fetch_returns_the_tensors_with_their_version(served) -> None:
    client = ReplayClient(served.address)
    first = client.publish("roundtrip", policy(1.0))
    second = client.publish("roundtrip", policy(2.0))
    assert second == first + 1
    got = client.fetch("roundtrip")
    assert isinstance(got, Variable) and got.version == second and got.name == "roundtrip"
    assert list(got) == list(policy(0.0))  # the state dict's keys, dots included, in order
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    net.load_state_dict(got)
    assert all((p == 2.0).all() for p in net.parameters())
    got["0.weight"].add_(1)  # the caller owns its tensors
    assert (client.fetch("roundtrip")["0.weight"] == 2.0).all()


def test_fetch_of_an_unknown_name_raises_naming_it(served) -> None:
    with pytest.raises(errors.UnknownVariableError, match="'never_published'"):
        ReplayClient(served.address).fetch("never_published")


def test_newer_than_returns_at_once_when_a_newer_version_exists(served) -> None:
    client = ReplayClient(served.address)
    version = client.publish("ahead", policy(1.0))
    assert client.fetch("ahead", newer_than=version - 1, timeout=0).version == version


def test_newer_than_blocks_until_a_publish(served) -> None:
    client = ReplayClient(served.address)
    version = client.publish("blocking", policy(1.0))
    out: list = []
    thread = threading.Thread(
        target=lambda: out.append(client.fetch("blocking", newer_than=version, timeout=JOIN_S)),
        daemon=True)
    thread.start()
    assert stays(lambda: not out, 0.5), f"fetch returned before a newer version: {out}"
    ReplayClient(served.address).publish("blocking", policy(5.0))
    thread.join(JOIN_S)
    assert out and out[0] is not None and out[0].version == version + 1
    assert (out[0]["0.bias"] == 5.0).all()


def test_newer_than_zero_waits_for_the_first_publish(served) -> None:
    client = ReplayClient(served.address)
    out: list = []
    thread = threading.Thread(
        target=lambda: out.append(client.fetch("first", newer_than=0, timeout=JOIN_S)),
        daemon=True)
    thread.start()
    assert stays(lambda: not out, 0.3)
    client.publish("first", policy(1.0))
    thread.join(JOIN_S)
    assert out and out[0].version == 1


def test_newer_than_times_out_with_none(served) -> None:
    client = ReplayClient(served.address)
    version = client.publish("quiet", policy(1.0))
    start = time.monotonic()
    assert client.fetch("quiet", newer_than=version, timeout=0.5) is None
    waited = time.monotonic() - start
    assert 0.3 <= waited < JOIN_S, waited
    assert client.fetch("quiet", newer_than=version, timeout=0) is None


@pytest.mark.parametrize("state, match", [
    ({}, "at least one tensor"),
    ({"w": torch.zeros(2), "step": 3}, "key 'step' holds a int"),
    ({"w": torch.zeros(2, dtype=torch.complex64)}, "key 'w' has dtype torch.complex64"),
    ("weights", "got str"),
])
def test_bad_state_dicts_are_refused_before_sending(served, state, match) -> None:
    client = ReplayClient(served.address)
    version = client.publish("kept", policy(1.0))
    with pytest.raises(errors.InvalidVariableError, match=match):
        client.publish("kept", state)
    assert client.fetch("kept").version == version


def test_bad_names_are_refused_by_the_server(served) -> None:
    client = ReplayClient(served.address)
    with pytest.raises(errors.InvalidVariableError, match="name ' bad' is invalid"):
        client.publish(" bad", policy(1.0))
    with pytest.raises(errors.InvalidVariableError, match="is invalid"):
        client.fetch("$x", newer_than=0, timeout=0)


def test_bad_fetch_arguments_are_refused_here(served) -> None:
    client = ReplayClient(served.address)
    with pytest.raises(errors.InvalidArgumentError, match="newer_than"):
        client.fetch("x", newer_than=-1)
    with pytest.raises(errors.InvalidArgumentError, match="timeout"):
        client.fetch("x", newer_than=0, timeout=-1)


def test_the_budget_refuses_a_publish_clearly_and_keeps_the_rest(served) -> None:
    client = ReplayClient(served.address)
    client.publish("small", {"w": torch.zeros(10)})
    with pytest.raises(errors.VariableBudgetError, match="'huge'.*variables_max_mb"):
        client.publish("huge", {"w": torch.zeros(2**20, dtype=torch.uint8)})
    with pytest.raises(errors.UnknownVariableError):
        client.fetch("huge")
    assert client.fetch("small").version >= 1


def test_variables_survive_a_checkpoint_and_restore(server_factory, tmp_path) -> None:
    config = CONFIG.replace("[server]\n", f'[server]\ncheckpoint_dir = "{tmp_path / "ckpt"}"\n')
    first = server_factory(config)
    client = ReplayClient(first.address)
    client.publish("policy", policy(1.0))
    version = client.publish("policy", policy(3.0))
    client.publish("stats", {"mean": torch.arange(3, dtype=torch.float64),
                             "half": torch.ones(2, dtype=torch.bfloat16)})
    client.checkpoint()
    assert first.stop() == 0
    second = server_factory(config, port=first.port)
    client = ReplayClient(second.address)
    got = client.fetch("policy")
    assert got.version == version and (got["0.weight"] == 3.0).all()
    stats = client.fetch("stats")
    assert stats["half"].dtype == torch.bfloat16 and torch.equal(stats["mean"],
                                                                 torch.arange(3.0).double())
    assert client.publish("policy", policy(4.0)) == version + 1  # versions never go back


def test_a_waiting_fetch_ends_when_the_server_stops(server_factory) -> None:
    proc = server_factory(CONFIG)
    client = ReplayClient(proc.address, max_retry_s=0.1)
    out: list = []

    def run() -> None:
        try:
            out.append(client.fetch("nothing", newer_than=0, timeout=None))
        except BaseException as exc:
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert stays(lambda: not out, 0.3)
    start = time.monotonic()
    assert proc.stop() == 0
    assert wait_for(lambda: out, JOIN_S)
    assert isinstance(out[0], errors.UnavailableError), out
    assert time.monotonic() - start < 5  # woken by the drain, not by the 5 s grace
