"""deploy/compose.yaml, its Prometheus and Grafana files, and the YAML style of deploy/.

No Compose engine runs here, so the checks are the ones that catch real mistakes:
every file a service mounts exists, the server's config is valid, Prometheus
scrapes the server's metrics port, the learner shares the server's /dev/shm,
and every query of the Grafana dashboard names a metric the server really exports.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
import yaml

from replay_server.app.config_file import settings_from_dict
from tests.deploy.tools import run_tool

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_KEYS = {"name", "services", "volumes", "networks", "configs", "secrets"}


def _compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def _services() -> dict:
    return _compose()["services"]


def _port(address: str) -> str:
    return address.rsplit(":", 1)[1]


def test_compose_has_the_server_two_actors_a_learner_and_prometheus() -> None:
    assert set(_compose()) <= COMPOSE_KEYS | {k for k in _compose() if k.startswith("x-")}
    services = _services()
    assert {"server", "actor-1", "actor-2", "learner", "prometheus"} <= set(services)
    for name in ("actor-1", "actor-2", "learner"):
        assert services[name]["depends_on"]["server"]["condition"] == "service_healthy", name
        assert services[name]["image"] == services["server"]["image"], name


def test_every_mounted_file_exists_and_the_servers_config_is_valid() -> None:
    for name, service in _services().items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), (name, source)
            else:
                assert source in _compose()["volumes"], (name, source)
    server = _services()["server"]
    mount = next(v for v in server["volumes"] if v.split(":")[1] == "/etc/replay/replay.toml")
    settings = settings_from_dict(tomllib.loads((DEPLOY / mount.split(":")[0]).read_text()))
    checkpoints = next(v for v in server["volumes"] if not v.startswith("."))
    assert checkpoints.split(":")[1] == settings.checkpoint_dir
    published = {p.split(":")[-1] for p in server["ports"]}
    assert published == {_port(settings.address), _port(settings.metrics_address)}
    assert all(p.startswith("127.0.0.1:") for s in _services().values() for p in s.get("ports", []))


def test_the_scripts_the_actors_and_learner_run_exist() -> None:
    for name in ("actor-1", "actor-2", "learner"):
        service = _services()[name]
        entry = service.get("entrypoint") or _services()["actor-1"]["entrypoint"]
        script = entry[-1]
        mount = next(v for v in service.get("volumes", _services()["actor-1"]["volumes"])
                     if script.startswith(v.split(":")[1]))
        assert (DEPLOY / mount.split(":")[0] / Path(script).name).is_file(), name


def test_the_learner_shares_the_servers_shm_and_the_server_drains_in_time() -> None:
    server, learner = _services()["server"], _services()["learner"]
    assert server["ipc"] == "shareable" and learner["ipc"] == "service:server"
    assert server["shm_size"]
    minutes = re.fullmatch(r"(\d+)m", server["stop_grace_period"])
    assert minutes and int(minutes.group(1)) >= 1


def test_prometheus_scrapes_the_servers_metrics_port() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    settings = settings_from_dict(tomllib.loads((DEPLOY / "replay.toml").read_text()))
    [job] = config["scrape_configs"]
    [static] = job["static_configs"]
    assert static["targets"] == [f"server:{_port(settings.metrics_address)}"]
    mounted = [v for v in _services()["prometheus"]["volumes"] if "prometheus.yml" in v]
    assert mounted


# ------------------------------------------------------------------ Grafana


def _dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "replay-dashboard.json").read_text())


def _exported_names(tmp_path_factory) -> set[str]:
    """Every sample name a real server's /metrics shows after one of each call."""
    import urllib.request

    import torch

    from replay_client import ReplayClient
    from tests.conftest import start_server

    tmp = tmp_path_factory.mktemp("dashboard")
    proc = start_server(tmp, f'[server]\nmetrics_address = "127.0.0.1:0"\n'
                             f'checkpoint_dir = "{tmp / "ck"}"\n[[tables]]\nname = "t"\n'
                             f'capacity = 10\nsampler = "prioritized"\n')
    try:
        client = ReplayClient(proc.address, timeout=30)
        client.insert("t", {"x": torch.zeros(2)})
        client.sample("t", 1)
        client.checkpoint()
        with client.stream("t", 1) as stream:
            next(stream)
        port = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/", proc.log())
        assert port
        with urllib.request.urlopen(f"http://127.0.0.1:{port.group(1)}/metrics") as response:
            text = response.read().decode()
    finally:
        proc.stop()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines()
            if line and not line.startswith("#")}


def test_every_dashboard_query_names_an_exported_metric(tmp_path_factory) -> None:
    exported = _exported_names(tmp_path_factory)
    panels = [p for p in _dashboard()["panels"] if p["type"] != "row"]
    assert len(panels) >= 15
    for panel in panels:
        for target in panel["targets"]:
            # every metric in the dashboard carries the $instance selector: name{...}
            names = set(re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{", target["expr"]))
            assert names, (panel["title"], target["expr"])
            assert names <= exported, (panel["title"], names - exported)


def test_grafana_provisioning_points_at_the_dashboard_and_prometheus() -> None:
    grafana = _services()["grafana"]
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/replay.yaml").read_text())
    path = provider["providers"][0]["options"]["path"]
    assert any(v.endswith(f"{path}/replay-dashboard.json:ro") for v in grafana["volumes"])
    source = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yaml")
                            .read_text())["datasources"][0]
    assert source["url"] == "http://prometheus:9090" and source["uid"] == "prometheus"
    assert _dashboard()["uid"] == "replay-server"


# ------------------------------------------------------------------- style

YAMLLINT = ("{extends: default, rules: {line-length: {max: 100}, document-start: disable, "
            "truthy: {check-keys: false}, comments: {min-spaces-from-content: 1}}}")


@pytest.mark.parametrize("path", sorted(p.relative_to(ROOT).as_posix()
                                        for p in DEPLOY.rglob("*.y*ml")))
def test_yaml_is_clean(path: str) -> None:
    result = run_tool("yamllint", "--strict", "-d", YAMLLINT, str(ROOT / path))
    assert result.returncode == 0, result.stdout + result.stderr
