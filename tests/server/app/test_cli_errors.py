"""The command line a new user meets: no abbreviations, plain help, one shape of error.

Issue 24, frictions 3 and 7: ``serve --port 50090`` was read as
``--port-file 50090``; ``--help`` showed raw reST; ``health`` printed its
failures on stdout while ``info`` and ``checkpoint`` used stderr;
``--address localhost`` went to port 443; a refused connection read as a
gRPC status dump, never as "no server there".
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from replay_server.app.cli import build_parser, main
from tests.conftest import module_server

server = module_server(None)  # one server with the default tables for the module

OPERATOR_COMMANDS = (["health"], ["info"], ["checkpoint"], ["reset", "replay"])


@pytest.fixture
def command(capsys):
    """``replay-server ARGS`` run in this process: exit status, stdout, stderr."""

    def run(*args: str) -> subprocess.CompletedProcess:
        try:
            code = main(list(args))
        except SystemExit as exit_:  # argparse: usage errors, --help, --version
            code = exit_.code
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)

    return run


def _cli(*args: str) -> subprocess.CompletedProcess:
    """``replay-server ARGS`` as a process (``serve`` would set up this process's logging)."""
    return subprocess.run([sys.executable, "-m", "replay_server.app.cli", *args],
                          capture_output=True, text=True, timeout=120, check=False)


def _parsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    [subparsers] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {"replay-server": parser, **subparsers.choices}


def test_no_parser_takes_abbreviations():
    parsers = _parsers()
    assert set(parsers) >= {"serve", "check-config", "health", "info", "checkpoint", "reset"}
    assert all(not p.allow_abbrev for p in parsers.values())


def test_serve_port_is_refused_not_taken_for_port_file(command):
    result = command("serve", "--port", "50090")
    assert result.returncode == 2
    assert "unrecognized arguments: --port 50090" in result.stderr
    assert "did you mean" not in result.stderr  # --port-file is not a typo of --port


@pytest.mark.parametrize(("args", "hint"), [
    (["info", "--adress", "127.0.0.1:1"], "'--adress': did you mean --address?"),
    (["serve", "--conifg", "x.toml"], "'--conifg': did you mean --config?"),
    (["reset", "replay", "--schemaa"], "'--schemaa': did you mean --schema?"),
])
def test_a_mistyped_flag_gets_its_commands_usage_and_the_closest_flag(args, hint, command):
    """``info --adress`` printed the top-level usage and no hint (issue 32, friction 8)."""
    result = command(*args)
    assert result.returncode == 2
    assert f"usage: replay-server {args[0]}" in result.stderr and hint in result.stderr
    assert f"replay-server {args[0]}: error: unrecognized arguments" in result.stderr


@pytest.mark.parametrize("name", ["replay-server", "serve", "check-config", "health", "info",
                                  "checkpoint", "reset"])
def test_help_is_plain_text(name, command):
    result = command(*([] if name == "replay-server" else [name]), "--help")
    assert result.returncode == 0 and result.stdout.startswith("usage: replay-server")
    for markup in ("``", ":mod:", ":class:", ":func:"):
        assert markup not in result.stdout, (name, markup)


@pytest.mark.parametrize("args", OPERATOR_COMMANDS, ids=lambda a: a[0])
def test_an_unreachable_server_is_one_line_on_stderr(args, command):
    result = command(*args, "--address", "127.0.0.1:1", "--timeout", "5")
    assert result.returncode == 1 and result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith("replay-server: error: no replay server at 127.0.0.1:1 "
                           "(is it running?)")


def test_a_refusal_by_the_server_is_one_line_on_stderr(server, command):
    result = command("reset", "no_such_table", "--address", server.address)
    assert result.returncode == 1 and result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith(f"replay-server: error: {server.address}: NOT_FOUND: ")
    assert "no_such_table" in line


def test_an_address_without_a_port_means_the_default_port_never_443(command):
    result = command("health", "--address", "localhost", "--timeout", "2")
    # Something may listen on 50051 on a shared machine: SERVING or not, the port is 50051.
    assert "localhost:50051" in result.stdout + result.stderr
    assert "443" not in result.stdout + result.stderr


@pytest.mark.parametrize("args", [["health", "--address", "localhost:http"],
                                  ["serve", "--address", "127.0.0.1:99999"]])
def test_a_malformed_address_is_a_usage_error_naming_it(args):
    result = _cli(*args)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("replay-server: configuration error: --address: address ")
    assert "is not a number from 0 to 65535" in result.stderr


def test_a_port_in_use_is_named_as_such(server):
    result = _cli("serve", "--address", server.address)
    assert result.returncode == 2
    assert (f"cannot listen on {server.address}: the port is in use (another replay-server?)"
            in result.stderr)
    # gRPC's own line ("add_port.cc ... Address already in use") came first before.
    assert "add_port" not in result.stderr and "Address already in use" not in result.stderr
