"""Every shell command in docs/operations.md and README.md is exercised, where it can run here.

Commands are taken from the ```bash blocks, one per line. ``replay-server``
commands run for real against servers this test starts (the doc's default
address is rewritten to theirs, as tests/test_docs.py does for Python), with
TLS certificates made under the names the doc uses; ``make`` targets must
exist (``make -n``); ``curl`` scrapes a real /metrics. ``docker`` and
``kubectl`` cannot run here: their arguments are checked against the
Dockerfile, deploy/compose.yaml and deploy/k8s (``make image-test`` runs the
container's life with podman). A command no rule covers fails the test, so a
new command in the doc needs a test.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.certs import Authority
from tests.conftest import ServerProcess, start_server, wait_for

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "docs" / "operations.md", ROOT / "README.md"]
BIN = Path(sys.executable).parent
DEFAULT = "127.0.0.1:50051"


def _commands() -> list:
    """Each distinct command line of the docs' bash blocks (comments stripped)."""
    found: dict[str, object] = {}
    for path in DOCS:
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.DOTALL):
            for line in block.replace("\\\n", " ").splitlines():
                command = " ".join(shlex.split(line, comments=True))
                if command and command not in found:
                    found[command] = pytest.param(line.split("  #")[0].strip(),
                                                  id=f"{path.name}: {command[:60]}")
    return list(found.values())


COMMANDS = _commands()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _toml_blocks(path: Path) -> list[str]:
    return re.findall(r"```toml\n(.*?)```", path.read_text(), re.DOTALL)


@pytest.fixture(scope="module")
def place(tmp_path_factory) -> Iterator[dict]:
    """A working directory with the doc's files, a plain server and a TLS server."""
    cwd = tmp_path_factory.mktemp("operations")
    ca = Authority(cwd, "ca")
    for name, pem in (("server", ca.server()), ("client", ca.client())):
        pem.cert.rename(cwd / f"{name}.crt")
        pem.key.rename(cwd / f"{name}.key")
    (cwd / "ca.crt").write_bytes(ca.cert.read_bytes())
    # the README's configuration example is the doc's replay.toml
    readme_config = next(t for t in _toml_blocks(ROOT / "README.md") if "[[tables]]" in t)
    (cwd / "replay.toml").write_text(readme_config)
    plain = start_server(cwd, f'[server]\ncheckpoint_dir = "{cwd / "plain-checkpoints"}"\n'
                              f'metrics_address = "127.0.0.1:0"\n', name="plain")
    tls_doc = next(t for t in _toml_blocks(ROOT / "docs" / "operations.md") if "tls_cert_file" in t)
    health_port = _free_port()
    tls_config = (tls_doc.replace('"0.0.0.0:50051"', '"127.0.0.1:0"')
                  .replace('"0.0.0.0:50052"', f'"127.0.0.1:{health_port}"'))
    for name in ("server.crt", "server.key", "ca.crt"):
        tls_config = tls_config.replace(f'"{name}"', f'"{cwd / name}"')
    tls = start_server(cwd, tls_config, name="tls", env={"REPLAY_TOKEN": "s3cret"})
    metrics = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/", plain.log())
    assert metrics
    yield {"cwd": cwd, "plain": plain, "tls": tls, "health_port": health_port,
           "metrics_port": int(metrics.group(1))}
    plain.stop()
    tls.stop()


def _run(command: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("command", COMMANDS)
def test_command(command: str, place: dict, monkeypatch, capsys) -> None:
    words = shlex.split(command)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        name, _, value = words.pop(0).partition("=")  # VAR=value prefixes
        monkeypatch.setenv(name, value)
    program = words[0]
    if program == "replay-server":
        monkeypatch.chdir(place["cwd"])
        _replay_server(command, words[1:], place, capsys)
    elif program == "make":
        _make(words[1:])
    elif program == "curl":
        _curl(command, place)
    elif program == "docker":
        _docker(words[1:])
    elif program == "kubectl":
        _kubectl(words[1:])
    elif program == "deploy/image/run.sh":  # podman run with the limits runc will set
        _docker(["run", *words[1:]])
    else:
        pytest.fail(f"no test exercises {command!r}: add a rule to tests/test_operations_doc.py")


# ------------------------------------------------------------ replay-server


def _replay_server(command: str, args: list[str], place: dict, capsys) -> None:
    """``serve`` runs as a process; the operator's commands run ``main`` in this process
    (the same code as the installed command, without an interpreter's start-up)."""
    from replay_server.app.cli import build_parser, main

    if args == ["--version"]:
        with pytest.raises(SystemExit) as exit_:
            main(args)
        assert exit_.value.code == 0 and capsys.readouterr().out.startswith("replay-server ")
        return
    parsed = build_parser().parse_args(args)
    if parsed.command == "serve":
        _serve(command, place)
        return
    if parsed.command == "check-config":  # the doc's replay.toml, in the doc's directory
        assert main(args) == 0, command
        assert capsys.readouterr().out.startswith(f"{parsed.file}: valid")
        return
    tls = any(a.startswith("--tls") for a in args)
    server: ServerProcess = place["tls"] if tls else place["plain"]
    if "127.0.0.1:50052" in args:
        args = [a.replace("127.0.0.1:50052", f"127.0.0.1:{place['health_port']}") for a in args]
    elif "--address" not in args:
        args = [*args, "--address", server.address]
    code = main(args)
    out, err = capsys.readouterr()
    assert code == 0, f"{command}\n{out}{err}"
    if parsed.command == "health":
        assert "SERVING" in out
    if parsed.command == "info" and not parsed.json:
        assert "table" in out and "memory" in out


def _serve(command: str, place: dict) -> None:
    """Run the doc's ``serve`` line on port 0 until SERVING, then SIGTERM it: exit 0.

    Each line is an alternative, so each runs in a directory of its own (with the
    doc's replay.toml): they would share ./checkpoints otherwise.
    """
    cwd = place["cwd"] / f"serve-{len(list(place['cwd'].glob('serve-*')))}"
    cwd.mkdir()
    (cwd / "replay.toml").write_text((place["cwd"] / "replay.toml").read_text())
    port_file = cwd / "serve.port"
    command += f" --address 127.0.0.1:0 --port-file {port_file}"
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    process = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=cwd, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_for(lambda: port_file.exists() and port_file.read_text().strip()
                        or process.poll() is not None, timeout=60)
        assert process.poll() is None, process.communicate()[0]
        from replay_server.app.cli import main

        assert main(["health", "--address", f"127.0.0.1:{port_file.read_text().strip()}"]) == 0
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=60)[0]
        assert process.returncode == 0, output
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


# --------------------------------------------------------------------- make


def _make(args: list[str]) -> None:
    result = subprocess.run(["make", "-n", *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    variables = dict(a.split("=", 1) for a in args if "=" in a)
    if "CONFIG" in variables:
        assert f"--config {variables['CONFIG']}" in result.stdout
    if args == ["serve"]:
        assert "--checkpoint-dir checkpoints" in result.stdout  # the quickstart keeps its rows


# --------------------------------------------------------------------- curl


def _curl(command: str, place: dict) -> None:
    command = command.replace("127.0.0.1:9100", f"127.0.0.1:{place['metrics_port']}")
    result = _run(command, place["cwd"])
    assert result.returncode == 0 and result.stdout.strip(), result.stderr
    wanted = command.rsplit("grep ", 1)[-1].strip()
    assert all(line.startswith(wanted) or wanted in line for line in result.stdout.splitlines())


# --------------------------------------------------------------- docker, kubectl


def _dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def _docker(args: list[str]) -> None:
    if args[0] == "build":
        assert args[-1] == "." and "-t" in args
        for pair in [args[i + 1] for i, a in enumerate(args) if a == "--build-arg"]:
            assert re.search(rf"^ARG {pair.split('=')[0]}=", _dockerfile(), re.MULTILINE), pair
    elif args[0] == "run":
        exposed = set(re.search(r"^EXPOSE (.+)$", _dockerfile(), re.MULTILINE).group(1).split())
        volume = re.search(r'^VOLUME \["(.+)"\]$', _dockerfile(), re.MULTILINE).group(1)
        for i, arg in enumerate(args):
            if arg == "-p":
                host, _, port = args[i + 1].rpartition(":")
                assert host.startswith("127.0.0.1") and port in exposed, args[i + 1]
            if arg == "-v":
                target = args[i + 1].split(":")[1]
                assert target in (volume, "/etc/replay/replay.toml"), args[i + 1]
        assert args[-1].startswith(("replay-server", "localhost/replay-server"))
    elif args[0] == "stop":
        assert int(args[args.index("-t") + 1]) >= 60  # room for the final checkpoint
    elif args[0] == "compose":
        compose = ROOT / args[args.index("-f") + 1]
        services = yaml.safe_load(compose.read_text())["services"]
        verb = args[args.index("-f") + 2]
        assert verb in ("up", "down", "logs", "ps"), verb
        if verb == "logs":
            assert args[-1] in services
    else:
        pytest.fail(f"no rule for docker {args[0]}")


def _kubectl(args: list[str]) -> None:
    k8s = ROOT / "deploy" / "k8s"
    statefulset = yaml.safe_load((k8s / "statefulset.yaml").read_text())
    name = statefulset["metadata"]["name"]
    if args[0] == "apply":
        assert args[1] == "-k" and (ROOT / args[2] / "kustomization.yaml").is_file()
    elif args[:2] == ["rollout", "status"]:
        assert args[2] == f"statefulset/{name}"
    elif args[0] == "port-forward":
        assert args[1] == f"pod/{name}-0"
        [container] = statefulset["spec"]["template"]["spec"]["containers"]
        ports = {p["containerPort"] for p in container["ports"]}
        for pair in args[2:]:
            assert int(pair.split(":")[1]) in ports, pair
    else:
        pytest.fail(f"no rule for kubectl {args[0]}")


def test_the_doc_has_commands_of_every_kind() -> None:
    programs = {shlex.split(p.values[0])[0] for p in COMMANDS} | {
        shlex.split(p.values[0])[1] for p in COMMANDS if "=" in shlex.split(p.values[0])[0]}
    assert {"replay-server", "make", "curl", "docker", "kubectl"} <= programs


def test_the_images_config_is_what_the_doc_says() -> None:
    config = tomllib.loads((ROOT / "deploy" / "image" / "replay.toml").read_text())["server"]
    doc = (ROOT / "docs" / "operations.md").read_text()
    assert config["address"] in doc and config["metrics_address"] in doc
    assert config["checkpoint_dir"] in doc
