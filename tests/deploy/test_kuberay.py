"""deploy/kuberay: the RayCluster and RayJob for a sharded replay, checked offline.

Nothing here runs KubeRay (no operator, no cluster on this machine). What is
checked: the ConfigMap and the checkpoint claim against Kubernetes' own
schemas, every pod template of the RayCluster against Kubernetes' PodTemplate
schema (kubernetes-validate, strict: unknown fields are errors), and what no
schema can see: the RayJob's entrypoint parses and makes a valid replay from
the ConfigMap's tables, its shards ask for the resource only the replay group
offers and checkpoint where those pods mount the shared claim, the learner
group has GPUs, and the job selects the cluster.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml

from replay_server.errors import ConfigError
from replay_server.ray.shard import shard_settings
from replay_server.ray.start import create_options
from tests.deploy.tools import run_tool

ROOT = Path(__file__).resolve().parents[2]
KUBERAY = ROOT / "deploy" / "kuberay"
KUBERNETES_VERSION = "1.30.0"


def _kustomization() -> dict:
    return yaml.safe_load((KUBERAY / "kustomization.yaml").read_text())


def _resources() -> dict[str, dict]:
    found = {}
    for name in _kustomization()["resources"]:
        for document in yaml.safe_load_all((KUBERAY / name).read_text()):
            found[document["kind"]] = document
    return found


def _groups() -> dict[str, dict]:
    spec = _resources()["RayCluster"]["spec"]
    return {"head": spec["headGroupSpec"],
            **{g["groupName"]: g for g in spec["workerGroupSpecs"]}}


def _mounts(group: dict) -> dict[str, str]:
    [container] = group["template"]["spec"]["containers"]
    return {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}


def _volumes(group: dict) -> dict[str, dict]:
    return {v["name"]: v for v in group["template"]["spec"].get("volumes", [])}


def _entrypoint(tmp_path: Path) -> tuple[list[str], tuple[str, dict]]:
    """The RayJob's entrypoint, and what it asks ReplayCluster.create for (its --config read
    from the ConfigMap, as the head pod mounts it)."""
    argv = shlex.split(_resources()["RayJob"]["spec"]["entrypoint"])
    config = tmp_path / "replay.toml"
    config.write_text(_resources()["ConfigMap"]["data"]["replay.toml"])
    args = argv[3:]
    at = args.index("--config")
    return argv, create_options([*args[:at + 1], str(config), *args[at + 2:]])


def test_every_manifest_in_the_folder_is_applied() -> None:
    listed = set(_kustomization()["resources"])
    assert listed == {p.name for p in KUBERAY.glob("*.yaml")} - {"kustomization.yaml"}


@pytest.mark.parametrize("manifest", ["configmap.yaml", "checkpoints.yaml"])
def test_core_manifests_are_valid_against_the_kubernetes_schema(manifest: str) -> None:
    result = run_tool("kubernetes-validate", "--strict", "-k", KUBERNETES_VERSION,
                      str(KUBERAY / manifest))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("group", ["head", "replay", "learner"])
def test_each_pod_template_is_a_valid_kubernetes_pod_template(group: str,
                                                              tmp_path: Path) -> None:
    wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": group},
               "template": _groups()[group]["template"]}
    path = tmp_path / f"{group}.yaml"
    path.write_text(yaml.safe_dump(wrapped))
    result = run_tool("kubernetes-validate", "--strict", "-k", KUBERNETES_VERSION, str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_kuberay_resources_are_v1_and_the_job_selects_the_cluster() -> None:
    cluster, job = _resources()["RayCluster"], _resources()["RayJob"]
    assert cluster["apiVersion"] == job["apiVersion"] == "ray.io/v1"
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    assert cluster["spec"]["rayVersion"].startswith("2.6")  # pyproject: ray>=2.60
    for name, group in _groups().items():
        assert all(isinstance(v, str) for v in group["rayStartParams"].values()), name
        if name != "head":
            assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


def test_the_job_makes_a_valid_replay_on_the_replay_group(tmp_path: Path) -> None:
    argv, (name, options) = _entrypoint(tmp_path)
    assert argv[:3] == ["python", "-m", "replay_server.ray.start"]
    assert options["get_if_exists"] is True  # a job run again finds the running replay
    settings = shard_settings(0, bind_host="127.0.0.1", server=options["server"],
                              tables=options["tables"], checkpoint_dir=options["checkpoint_dir"],
                              replay=name)
    assert [t.name for t in settings.tables] == ["replay", "sequences"]
    groups = _groups()
    offered = {g: json.loads(json.loads(p["rayStartParams"].get("resources", '"{}"')))
               for g, p in groups.items()}
    wanted = set(options["shard_options"]["resources"])
    assert wanted and [g for g, r in offered.items() if wanted <= set(r)] == ["replay"]
    replay = groups["replay"]
    assert options["num_shards"] <= replay["replicas"]  # one shard per replay pod
    claim = next(n for n, v in _volumes(replay).items() if "persistentVolumeClaim" in v)
    assert _mounts(replay)[claim] == options["checkpoint_dir"]
    assert _volumes(replay)[claim]["persistentVolumeClaim"]["claimName"] == (
        _resources()["PersistentVolumeClaim"]["metadata"]["name"])
    assert _resources()["PersistentVolumeClaim"]["spec"]["accessModes"] == ["ReadWriteMany"]
    head = groups["head"]  # the job's driver runs on the head: the tables are mounted there
    config = argv[argv.index("--config") + 1]
    mount = next(n for n, p in _mounts(head).items() if p == str(Path(config).parent))
    assert _volumes(head)[mount]["configMap"]["name"] == (
        _resources()["ConfigMap"]["metadata"]["name"])


def test_the_learner_group_has_gpus_and_the_head_runs_no_shard() -> None:
    groups = _groups()
    learner = groups["learner"]
    [container] = learner["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == learner["rayStartParams"][
        "num-gpus"] == "1"
    assert groups["head"]["rayStartParams"]["num-cpus"] == "0"


def test_the_entrypoint_refuses_bad_arguments_by_name(tmp_path: Path) -> None:
    config = tmp_path / "replay.toml"
    config.write_text('[[tables]]\nname = "u"\ncapacity = 10\n')
    base = ["r", "--config", str(config), "--num-shards", "2"]
    assert create_options(base)[1]["shard_options"] == {"num_cpus": 1.0, "resources": {}}
    with pytest.raises(ConfigError, match="--shard-resources is not JSON"):
        create_options([*base, "--shard-resources", "{replay: 1}"])
    with pytest.raises(ConfigError, match="must be a JSON object"):
        create_options([*base, "--shard-resources", "[1]"])
    with pytest.raises(ConfigError, match="--config .*absent.toml"):
        create_options(["r", "--config", str(tmp_path / "absent.toml"), "--num-shards", "1"])
