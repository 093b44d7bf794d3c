"""The gRPC experiments the server turns off (replay_server.grpc_experiments).

The behaviour they protect (no call of another connection cancelled when a reset flood
ends) is tested through a real server in tests/integration/test_http2_floods.py."""

from __future__ import annotations

import subprocess
import sys

from replay_server import grpc_experiments as ge

AFFECTED = (1, 85)
OLD = (1, 81)


def test_an_affected_grpcio_gets_the_experiment_turned_off_before_grpc_starts():
    env: dict[str, str] = {}
    assert ge.turn_off(env, AFFECTED, grpc_imported=False) == ["optimization_04"]
    assert env == {"GRPC_EXPERIMENTS": "-optimization_04"}
    assert ge.state(env, AFFECTED) == (
        True, "gRPC experiments off: optimization_04 (known to cancel calls)")


def test_the_operators_own_experiments_are_kept_and_an_explicit_choice_wins():
    env = {"GRPC_EXPERIMENTS": "tcp_rcv_lowat,-event_engine_client"}
    ge.turn_off(env, AFFECTED, grpc_imported=False)
    assert env["GRPC_EXPERIMENTS"] == "tcp_rcv_lowat,-event_engine_client,-optimization_04"
    assert ge.turn_off(env, AFFECTED, grpc_imported=False) == []  # not named twice
    chosen = {"GRPC_EXPERIMENTS": "optimization_04"}  # turned on on purpose: left on ...
    assert ge.turn_off(chosen, AFFECTED, grpc_imported=False) == []
    assert chosen == {"GRPC_EXPERIMENTS": "optimization_04"}
    sound, why = ge.state(chosen, AFFECTED)  # ... and the start-up log warns
    assert not sound
    assert "GRPC_EXPERIMENTS=-optimization_04" in why and "1.85" in why


def test_nothing_is_named_to_a_grpcio_that_does_not_know_the_experiment():
    env: dict[str, str] = {}
    assert ge.turn_off(env, OLD, grpc_imported=False) == []
    assert env == {}  # naming it there makes gRPC log "Unknown experiment" at start
    assert ge.state(env, OLD)[0]


def test_too_late_once_grpc_is_imported_and_the_log_says_so():
    env: dict[str, str] = {}
    assert ge.turn_off(env, AFFECTED, grpc_imported=True) == []
    assert env == {}  # a variable gRPC no longer reads would report a fix not in force
    assert not ge.state(env, AFFECTED)[0]


def test_a_child_process_environment_gets_it_with_its_other_variables():
    extra = {"OMP_NUM_THREADS": "1"}
    child = ge.for_a_child(extra)
    version = ge.grpc_version()
    if ge.affecting(version):
        assert child == {"OMP_NUM_THREADS": "1", "GRPC_EXPERIMENTS": "-optimization_04"}
    else:
        assert child == extra
    assert extra == {"OMP_NUM_THREADS": "1"}  # the caller's mapping is not changed
    assert ge.for_a_child(None) == ({} if not ge.affecting(version)
                                    else {"GRPC_EXPERIMENTS": "-optimization_04"})


def test_the_module_imports_no_grpc():
    code = ("import sys; import replay_server.grpc_experiments; "
            "print('grpc' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
