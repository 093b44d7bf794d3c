"""``replay-server`` as a real process: serve, health, info, shutdown."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.conftest import module_server, start_server

# One server with the default tables for the module: each test reads or writes its own table.
server = module_server(None)


def _cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "replay_server.app.cli", *args],
                          capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture
def command(capsys):
    """An operator's command (``health``, ``info``, ``checkpoint``) run in this process."""
    from replay_server.app.cli import main

    def run(*args: str) -> subprocess.CompletedProcess:
        code = main(list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)

    return run


def test_serve_without_config_announces_the_default_tables(server):
    log = server.log()
    assert "no config given: serving the default tables" in log
    for name in ("replay", "uniform", "slice", "prioritized_slice"):
        assert f"table {name!r}" in log
    assert f"listening on 127.0.0.1:{server.port}" in log


def test_health_reports_serving(server):
    result = _cli("health", "--address", server.address)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SERVING" in result.stdout


def test_health_of_a_dead_address_fails_naming_it_on_stderr():
    result = _cli("health", "--address", "127.0.0.1:1", "--timeout", "2")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith(
        "replay-server: error: no replay server at 127.0.0.1:1 (is it running?)")


def test_info_prints_every_table_as_a_readable_table_in_human_units(server, command):
    from replay_client import ReplayClient

    import torch

    ReplayClient(server.address).insert("uniform", {"obs": torch.zeros(3, 2)})
    result = command("info", "--address", server.address)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("replay-server ") and "resident" in lines[0]
    assert "no checkpoint_dir: rows are lost at stop" in lines[0]
    assert lines[1].split()[:6] == ["table", "sampler", "size", "capacity", "fill", "memory"]
    uniform = next(line for line in lines if line.startswith("uniform "))
    # 100,000 rows of 2 float32: 781 KiB of storage
    assert uniform.split()[1:7] == ["uniform", "3", "100k", "0.0%", "781", "KiB"]
    assert "uniform columns: obs: float32[2]" in result.stdout


def test_info_json_has_every_figure_exact(server, command):
    import json

    from replay_client import ReplayClient

    import torch

    client = ReplayClient(server.address)
    client.insert("replay", {"obs": torch.zeros(1234, 2)})
    client.sample("replay", 7)
    result = command("info", "--address", server.address, "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    replay = next(t for t in info["tables"] if t["name"] == "replay")
    assert (replay["size"], replay["capacity"], replay["storage_bytes"]) == (1234, 100_000, 800_000)
    assert replay["counters"]["inserted"] == 1234 and replay["counters"]["sampled"] == 7
    assert replay["schema"] == {"obs": "float32[2]"}
    assert replay["rate_limiter"]["max_diff"] == "inf"      # non-finite: a string, still JSON
    assert info["server"]["rss_bytes"] > 0 and info["server"]["checkpoint_dir"] == ""
    assert info["last_checkpoint"] is None


def test_every_operator_command_defaults_to_the_local_server():
    from replay_server.app.cli import build_parser

    parser = build_parser()
    for command in ("health", "info", "checkpoint"):
        assert parser.parse_args([command]).address == "127.0.0.1:50051"


def test_version_prints_the_installed_version(capsys):
    from importlib import metadata

    from replay_server.app.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"replay-server {metadata.version('replay-server')}"


def test_serve_warns_that_rows_are_lost_without_a_checkpoint_dir(server, tmp_path, command):
    assert "WARNING" in server.log() and "no checkpoint_dir: every row is lost" in server.log()
    kept = start_server(tmp_path, name="kept", extra_args=["--checkpoint-dir",
                                                            str(tmp_path / "ck")])
    try:
        assert "no checkpoint_dir" not in kept.log()
        result = command("checkpoint", "--address", kept.address)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip().startswith(str(tmp_path / "ck"))
    finally:
        kept.stop()


def test_sigterm_drains_and_exits_zero(tmp_path):
    proc = start_server(tmp_path)
    assert proc.stop(signal.SIGTERM) == 0
    log = proc.log()
    assert "SIGTERM received: draining" in log and "stopped" in log


def test_sigint_also_stops_cleanly(tmp_path):
    proc = start_server(tmp_path)
    assert proc.stop(signal.SIGINT) == 0


def test_bad_config_exits_2_with_the_reason(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text('[[tables]]\nname = "t"\ncapacity = 0\n')
    result = _cli("serve", "--config", str(config))
    assert result.returncode == 2
    assert "capacity must be an integer" in result.stderr and "0" in result.stderr


def test_json_log_format_writes_one_object_per_line(server_factory):
    import json

    proc = server_factory('[server]\nlog_format = "json"\n[[tables]]\nname = "t"\ncapacity = 10\n')
    records = [json.loads(line) for line in proc.log().splitlines() if line.startswith("{")]
    assert any(r["msg"].startswith("listening on") for r in records)
    assert all({"ts", "level", "logger", "msg"} <= set(r) for r in records)


def test_checkpoint_without_a_checkpoint_dir_exits_1_saying_why(server):
    result = _cli("checkpoint", "--address", server.address)
    assert result.returncode == 1
    assert "FAILED_PRECONDITION" in result.stderr and "server.checkpoint_dir" in result.stderr
