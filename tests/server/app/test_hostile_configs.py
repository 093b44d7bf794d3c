"""``check-config`` and ``serve`` on config files no operator meant to give (issue 34, item 13).

Binary garbage, a value nested thousands deep, a symlink loop, a FIFO, a directory, a file
of many megabytes and expired or mismatched TLS files: each is refused with exit status 2
and one line naming the file and what is wrong with it, never a traceback and never a
hang (a FIFO is opened without blocking). ``check-config`` reads the file through the
same code ``serve`` does, so what one refuses the other refuses with the same words.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.certs import Authority


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "replay_server.app.cli", *args],
                          capture_output=True, text=True, timeout=60)


def _garbage(path: Path) -> str:
    path.write_bytes(bytes(range(256)) * 4)
    return "is not UTF-8 text (byte 128 is 0x80)"


def _deep(path: Path) -> str:
    path.write_text("x = " + "[" * 5000 + "]" * 5000 + "\n")
    return "nests arrays or tables too deeply"


def _loop(path: Path) -> str:
    os.symlink(path.with_name("other.toml"), path)
    os.symlink(path, path.with_name("other.toml"))
    return "Too many levels of symbolic links"


def _fifo(path: Path) -> str:
    os.mkfifo(path)
    return "is a FIFO, not a regular file"


def _directory(path: Path) -> str:
    path.mkdir()
    return "is a directory, not a regular file"


def _huge(path: Path) -> str:
    with open(path, "w") as file:
        file.write("# padding\n" * 200_000)
    return "is over 1 MiB: not a config"


HOSTILE = {"garbage": _garbage, "deep": _deep, "loop": _loop, "fifo": _fifo,
           "directory": _directory, "huge": _huge}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_check_config_refuses_in_one_line(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "replay.toml"
    words = HOSTILE[kind](path)
    done = _cli("check-config", str(path))
    assert done.returncode == 2, done
    assert "Traceback" not in done.stderr and str(path) in done.stderr, done.stderr
    assert words in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.parametrize("kind", ["fifo", "garbage"])
def test_serve_refuses_them_with_the_same_words(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "replay.toml"
    words = HOSTILE[kind](path)
    done = _cli("serve", "--config", str(path), "--address", "127.0.0.1:0")
    assert done.returncode == 2 and words in done.stderr, done
    assert "Traceback" not in done.stderr


def test_check_config_reads_the_tls_files_as_serve_does(tmp_path: Path) -> None:
    authority = Authority(tmp_path)
    server = authority.server("server")
    other = authority.server("other")
    expired = authority.server("expired", valid_days=(-3, -1))
    config = tmp_path / "replay.toml"
    config.write_text(f'[server]\ntls_cert_file = "{server.cert}"\n'
                      f'tls_key_file = "{other.key}"\n')
    done = _cli("check-config", str(config))
    assert done.returncode == 2, done
    assert "are not a PEM certificate chain and its private key" in done.stderr, done.stderr
    config.write_text(f'[server]\ntls_cert_file = "{expired.cert}"\n'
                      f'tls_key_file = "{expired.key}"\n')
    done = _cli("check-config", str(config))
    assert done.returncode == 2 and "has expired" in done.stderr, done
    config.write_text(f'[server]\ntls_cert_file = "{server.cert}"\n'
                      f'tls_key_file = "{server.key}"\n')
    assert _cli("check-config", str(config)).returncode == 0
