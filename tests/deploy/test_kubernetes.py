"""deploy/k8s: every manifest against Kubernetes' own schemas (offline), and against the server.

kubernetes-validate checks each resource strictly (unknown fields are errors);
the other tests check what a schema cannot: that the probes, ports, mounts and
labels agree with the server's config in the ConfigMap and with the image.
"""

from __future__ import annotations

import os
import re
import tomllib
from unittest import mock
from pathlib import Path

import pytest
import yaml

from replay_server.app.config_file import settings_from_dict
from tests.deploy.tools import run_tool

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.30.0"  # the oldest release with every field used here (pod-index label)


def _kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def _resources() -> dict[str, dict]:
    found = {}
    for name in _kustomization()["resources"]:
        for document in yaml.safe_load_all((K8S / name).read_text()):
            found[document["kind"]] = document
    return found


def _pod() -> dict:
    return _resources()["StatefulSet"]["spec"]["template"]


def _container() -> dict:
    [container] = _pod()["spec"]["containers"]
    return container


def _settings(pod_index: str = "0"):
    """The ConfigMap's config as the pod with ``pod_index`` reads it (its REPLAY_SHARD_INDEX)."""
    with mock.patch.dict(os.environ, {"REPLAY_SHARD_INDEX": pod_index}):
        return settings_from_dict(tomllib.loads(_resources()["ConfigMap"]["data"]["replay.toml"]))


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


@pytest.mark.parametrize("manifest", _kustomization()["resources"])
def test_manifest_is_valid_against_the_kubernetes_schema(manifest: str) -> None:
    result = run_tool("kubernetes-validate", "--strict", "-k", KUBERNETES_VERSION,
                      str(K8S / manifest))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_manifest_in_the_folder_is_applied() -> None:
    listed = set(_kustomization()["resources"])
    present = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present


def test_the_configmap_holds_a_valid_server_config() -> None:
    settings = _settings()
    assert settings.address.startswith("0.0.0.0:")  # reachable from other pods
    assert settings.checkpoint_dir and settings.metrics_address and settings.health_address


def test_probes_use_native_grpc_on_the_plaintext_health_listener() -> None:
    container, health = _container(), _port(_settings().health_address)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == health, probe
    # ready: the replay service itself is SERVING (NOT_SERVING while restoring or draining)
    assert container["readinessProbe"]["grpc"]["service"] == "replay.v1.ReplayService"
    # a restore of a large table must not be killed: the startup probe waits minutes
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


def test_container_ports_and_service_match_the_config() -> None:
    settings = _settings()
    ports = {p["name"]: p["containerPort"] for p in _container()["ports"]}
    assert ports == {"grpc": _port(settings.address), "health": _port(settings.health_address),
                     "metrics": _port(settings.metrics_address)}
    service = _resources()["Service"]
    assert service["spec"]["clusterIP"] == "None"  # headless: one DNS name per shard
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(ports)
    assert _resources()["StatefulSet"]["spec"]["serviceName"] == service["metadata"]["name"]
    annotations = _pod()["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(ports["metrics"])


def test_selectors_match_the_pods() -> None:
    labels = _pod()["metadata"]["labels"]
    resources = _resources()
    for selector in (resources["StatefulSet"]["spec"]["selector"]["matchLabels"],
                     resources["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"],
                     resources["Service"]["spec"]["selector"]):
        assert selector.items() <= labels.items()


def test_volumes_checkpoints_on_a_claim_and_shm_in_memory() -> None:
    statefulset = _resources()["StatefulSet"]
    mounts = {m["name"]: m["mountPath"] for m in _container()["volumeMounts"]}
    volumes = {v["name"]: v for v in _pod()["spec"]["volumes"]}
    [claim] = statefulset["spec"]["volumeClaimTemplates"]
    assert mounts[claim["metadata"]["name"]] == _settings().checkpoint_dir
    shm = next(name for name, path in mounts.items() if path == "/dev/shm")
    assert volumes[shm]["emptyDir"]["medium"] == "Memory"
    assert volumes["config"]["configMap"]["name"] == _resources()["ConfigMap"]["metadata"]["name"]
    assert _container()["args"] == ["serve", "--config", f"{mounts['config']}/replay.toml"]


def test_the_pod_runs_as_the_images_user_and_drains_in_time() -> None:
    spec = _pod()["spec"]
    user = re.search(r"^USER (\d+):(\d+)$", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    assert user
    context = spec["securityContext"]
    assert (context["runAsUser"], context["runAsGroup"], context["fsGroup"]) == (
        int(user.group(1)), int(user.group(2)), int(user.group(2)))
    assert context["runAsNonRoot"] is True
    # SIGTERM: 10 s of drain, then the final checkpoint of all table memory
    assert spec["terminationGracePeriodSeconds"] >= 120


def test_resources_are_set_and_the_shard_index_is_passed() -> None:
    resources = _container()["resources"]
    assert resources["requests"]["memory"] and resources["limits"]["memory"]
    env = {e["name"]: e for e in _container()["env"]}
    assert env["REPLAY_SHARD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.labels['apps.kubernetes.io/pod-index']")


def test_each_pod_of_the_statefulset_is_the_shard_of_its_ordinal() -> None:
    replicas = _resources()["StatefulSet"]["spec"]["replicas"]
    assert replicas >= 2  # a sharded replay
    assert [_settings(str(i)).shard for i in range(replicas)] == list(range(replicas))
    assert _resources()["PodDisruptionBudget"]["spec"]["maxUnavailable"] == 1
