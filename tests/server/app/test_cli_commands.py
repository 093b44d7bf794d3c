"""What issue 24 added to the command line, each through a real server process.

``check-config`` (a config checked without starting), ``reset TABLE
[--schema]``, ``--log-level``, ``info`` naming the restored checkpoint, and
a start refused by checkpoints of another config listing all of them and
the two ways out (the Quickstart's ``make serve`` then ``make serve
CONFIG=replay.toml`` met it one checkpoint at a time).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from replay_client import ReplayClient
from tests.conftest import serve_until_exit, start_server


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "replay_server.app.cli", *args],
                          capture_output=True, text=True, timeout=120, check=False)


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "replay.toml"
    path.write_text(text)
    return path


def test_check_config_reports_a_valid_config_without_touching_anything(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    path = _config(tmp_path, f'[server]\naddress = "0.0.0.0:7000"\ncheckpoint_dir = '
                             f'"{checkpoints}"\n[[tables]]\nname = "seq"\ncapacity = 5000\n'
                             f'sampler = "slice"\nslice_len = 16\n')
    result = _cli("check-config", str(path))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"{path}: valid"
    assert "listens on 0.0.0.0:7000" in result.stdout
    assert f"checkpoints in {checkpoints}: none yet" in result.stdout
    assert "  seq: slice, capacity 5,000, slice_len=16" in lines
    assert not checkpoints.exists()  # nothing created, nothing locked


@pytest.mark.parametrize(("text", "wanted"), [
    ('[[tables]]\nname = "t"\ncapacty = 10\n', "unknown key 'capacty' (did you mean 'capacity'?)"),
    ('[server]\ncheckpoint-dir = "c"\n', "unknown key 'checkpoint-dir' (did you mean "
                                          "'checkpoint_dir'?)"),
    ('[[tables]]\nname = "t"\ncapacity = 10\ncheckpoint_dir = "c"\n',
     "unknown key 'checkpoint_dir' (a key of [server]"),
    ('[table]\nname = "t"\n', "unknown top-level sections ['table'] (did you mean 'tables'?)"),
    ('[server]\ntable_memory_mb = 1\n[[tables]]\nname = "big"\ncapacity = 10_000_000\n'
     'sampler = "prioritized"\n', "more than server.table_memory_mb allows"),
])
def test_check_config_refuses_what_serve_would_naming_it(tmp_path, text, wanted):
    result = _cli("check-config", str(_config(tmp_path, text)))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("replay-server: configuration error: ")
    assert wanted in result.stderr


def test_check_config_names_both_places_a_write_ahead_log_could_go(tmp_path):
    result = _cli("check-config", str(_config(tmp_path, "[server]\nwal = true\n")))
    assert result.returncode == 2 and result.stdout == ""
    assert "server.wal = true needs a place for the log" in result.stderr
    assert "server.checkpoint_dir" in result.stderr and "server.wal_dir" in result.stderr


def test_check_config_says_which_sync_level_a_write_ahead_log_has(tmp_path):
    fsync = _cli("check-config", str(_config(tmp_path, f'[server]\nwal = true\ncheckpoint_dir = '
                                                       f'"{tmp_path / "c"}"\n')))
    assert fsync.returncode == 0, fsync.stderr
    assert "wal_sync = fsync: an acknowledged change survives a crash of the process or the " \
           "machine" in fsync.stdout
    os_level = _cli("check-config", str(_config(tmp_path, f'[server]\nwal = true\nwal_sync = '
                                                          f'"os"\nwal_dir = "{tmp_path}"\n')))
    assert "wal_sync = os: an acknowledged change survives a crash of the process" in \
        os_level.stdout
    bad = _cli("check-config", str(_config(tmp_path, '[server]\nwal = true\nwal_sync = "always"\n'
                                                     'wal_dir = "w"\n')))
    assert bad.returncode == 2 and "server.wal_sync must be 'fsync'" in bad.stderr


def test_reset_with_schema_from_the_command_line(server):
    client = ReplayClient(server.address)
    client.insert("uniform", {"obs": torch.zeros(4, 3)})
    kept = _cli("reset", "uniform", "--address", server.address)
    assert kept.returncode == 0 and "its schema stays" in kept.stdout, kept.stderr
    assert client.info()["uniform"].schema == {"obs": "float32[3]"}
    forgot = _cli("reset", "uniform", "--schema", "--address", server.address)
    assert forgot.returncode == 0, forgot.stderr
    assert client.info()["uniform"].schema == {} and client.info()["uniform"].size == 0
    client.insert("uniform", {"observation": torch.zeros(2, 5)})
    assert client.info()["uniform"].schema == {"observation": "float32[5]"}
    client.close()


def test_log_level_warning_shows_warnings_only(tmp_path):
    proc = start_server(tmp_path, extra_args=("--log-level", "warning"))
    try:
        log = proc.log()
        assert "WARNING" in log and "no checkpoint_dir" in log
        assert " INFO " not in log
    finally:
        proc.stop()


def test_info_names_the_checkpoint_restored_at_start(tmp_path):
    args = ("--checkpoint-dir", str(tmp_path / "ck"))
    first = start_server(tmp_path, extra_args=args)
    ReplayClient(first.address).insert("replay", {"obs": torch.zeros(3, 2)})
    fresh = _cli("info", "--address", first.address, "--json")
    assert json.loads(fresh.stdout)["server"]["restored_checkpoint"] == ""
    assert first.stop() == 0
    [written] = [p for p in (tmp_path / "ck").iterdir() if p.name.startswith("ckpt-")]
    second = start_server(tmp_path, name="second", extra_args=args)
    try:
        text = _cli("info", "--address", second.address)
        assert f"restored at start from: {written}" in text.stdout, text.stderr
        info = json.loads(_cli("info", "--address", second.address, "--json").stdout)
        assert info["server"]["restored_checkpoint"] == str(written)
    finally:
        second.stop()


def test_checkpoints_of_another_config_are_all_listed_with_both_ways_out(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    default = start_server(tmp_path, extra_args=("--checkpoint-dir", str(checkpoints)))
    client = ReplayClient(default.address)
    client.insert("replay", {"obs": torch.zeros(3, 2)})
    client.checkpoint()
    client.checkpoint()
    client.close()
    assert default.stop() == 0  # the third checkpoint
    written = sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("ckpt-"))
    assert len(written) == 3
    code, output = serve_until_exit(
        tmp_path, f'[server]\ncheckpoint_dir = "{checkpoints}"\n[[tables]]\nname = "replay"\n'
                  f'capacity = 1000\nsampler = "prioritized"\n')
    assert code == 2
    assert f"checkpoint {checkpoints / written[-1]} does not fit the config" in output
    assert "it holds table(s) ['uniform', 'slice', 'prioritized_slice', 'fifo', 'lifo'] " \
           "which the config does not declare" in output
    assert f"so do 2 older checkpoint(s): {written[1]}, {written[0]}" in output
    assert "Two ways out: start with the config the checkpoints were written with" in output
    assert "another checkpoint directory (server.checkpoint_dir, or --checkpoint-dir)" in output
    assert f"move all 3 of them out of {checkpoints}" in output
