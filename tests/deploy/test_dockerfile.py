"""The Dockerfile, statically: hadolint's lint, and what the image promises operators.

(`make image-test` builds and runs the image for real; it takes minutes, so it is not
part of `make test`.)
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from replay_server.app.config_file import settings_from_dict
from tests.deploy.tools import run_tool

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` of the final stage, continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines()
             if line.strip() and not line.strip().startswith("#")]
    stages: list[list[tuple[str, str]]] = [[]]
    for line in lines:
        word, _, rest = line.partition(" ")
        if word.upper() == "FROM":
            stages.append([])
        stages[-1].append((word.upper(), rest.strip()))
    return stages[-1]


def _one(name: str) -> str:
    [value] = [rest for word, rest in _instructions() if word == name]
    return value


def test_hadolint_finds_nothing() -> None:
    result = run_tool("hadolint", "--failure-threshold", "info", str(DOCKERFILE))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_server_runs_as_a_non_root_user() -> None:
    # numeric, so Kubernetes' runAsNonRoot can check it (deploy/k8s/statefulset.yaml)
    assert _one("USER") == "10001:10001"
    users = [i for i, (word, _) in enumerate(_instructions()) if word == "USER"]
    entry = [i for i, (word, _) in enumerate(_instructions()) if word == "ENTRYPOINT"]
    assert users and entry and users[-1] < entry[0]


def test_sigterm_reaches_the_server_as_pid_1() -> None:
    # exec form: no shell in between to swallow the signal
    assert _one("ENTRYPOINT") == '["replay-server"]'
    assert _one("CMD").startswith('["serve"')
    assert _one("STOPSIGNAL") == "SIGTERM"


def test_healthcheck_asks_the_server_itself() -> None:
    healthcheck = _one("HEALTHCHECK")
    # JSON form through sh, so that $REPLAY_HEALTH_ADDRESS (health_address under TLS) expands
    assert r'"exec replay-server health --address \"$REPLAY_HEALTH_ADDRESS\"' in healthcheck


def test_ports_and_volume_match_the_images_config() -> None:
    config = settings_from_dict(tomllib.loads((ROOT / "deploy/image/replay.toml").read_text()))
    exposed = set(_one("EXPOSE").split())
    ports = {config.address.rsplit(":", 1)[1], config.metrics_address.rsplit(":", 1)[1]}
    assert exposed == ports
    assert _one("VOLUME") == f'["{config.checkpoint_dir}"]'
    assert f"REPLAY_HEALTH_ADDRESS=127.0.0.1:{config.address.rsplit(':', 1)[1]}" in _one("ENV")


def test_the_build_context_holds_what_the_build_uses() -> None:
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert "**" in ignore  # everything else (.venv, checkpoints, .git) stays out
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    copied = re.findall(r"^COPY (?!--from)(.+) /\S*$", DOCKERFILE.read_text(), re.MULTILINE)
    [mounted] = re.findall(r"cp -r ((?:/context/\S+\s+)+)/tmp/src/;", text)
    sources = [s for line in copied for s in line.split()]
    sources += [s.removeprefix("/context/") for s in mounted.split()]
    kept = [line[1:].rstrip("/") for line in ignore if line.startswith("!")]
    for source in [*sources, "deploy/image/pip"]:
        assert (ROOT / source).exists(), source
        assert any(source == k or source.startswith(k + "/") for k in kept), source


def test_the_sources_never_become_a_layer() -> None:
    # Under podman's vfs driver (CI) each stage and layer is a full copy of the file
    # system: the sources come in on a bind mount, and there is one stage.
    text = DOCKERFILE.read_text()
    assert len(re.findall(r"^FROM ", text, re.MULTILINE)) == 1
    copied = re.findall(r"^COPY (.+)$", text, re.MULTILINE)
    assert copied == ["deploy/image/replay.toml /etc/replay/replay.toml"]
    assert "--mount=type=bind,source=.,target=/context" in text


@pytest.mark.parametrize("argument", ["BASE_IMAGE", "TORCH_VERSION", "TORCH_INDEX_URL"])
def test_the_build_arguments_are_declared(argument: str) -> None:
    assert re.search(rf"^ARG {argument}=", DOCKERFILE.read_text(), re.MULTILINE)


def test_the_default_torch_is_the_pinned_cpu_build() -> None:
    text = DOCKERFILE.read_text()
    pinned = re.search(r"^torch==(\S+)$", (ROOT / "constraints.txt").read_text(), re.MULTILINE)
    assert pinned and f"ARG TORCH_VERSION={pinned.group(1)}" in text
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text


def test_the_image_installs_against_the_constraints_the_tests_ran_with() -> None:
    # Issue 24: the image had tensordict 0.15.3 where the tested venv had 0.13.0.
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    [install] = re.findall(r"/opt/replay/bin/pip install [^;]* /tmp/src;", text)
    assert "-c /tmp/src/constraints.txt" in install
    assert re.search(r"cp -r [^;]*/context/constraints\.txt[^;]* /tmp/src/;", text)


def test_the_constraints_are_what_the_test_venv_has() -> None:
    from importlib import metadata

    pins = re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", (ROOT / "constraints.txt").read_text(),
                      re.MULTILINE)
    assert ("tensordict", metadata.version("tensordict")) in pins
    for name, version in pins:
        installed = metadata.version(name).split("+")[0]  # torch's "+cpu"
        assert installed == version, (name, installed, version)
