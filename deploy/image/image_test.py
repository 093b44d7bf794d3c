"""`make image-test`: the image, built and run for real (podman; no Docker daemon needed).

    python deploy/image/image_test.py [IMAGE]      (default localhost/replay-server:dev)

1. The image runs as a non-root user, declares its HEALTHCHECK, ports and volume.
2. A container starts with a checkpoint volume and published ports (loopback only);
   ``replay-server health`` from outside reports SERVING, and so does the image's own
   HEALTHCHECK; the server is PID 1; its packages are the versions constraints.txt pins
   (those `make test` ran with); ``replay-server check-config`` accepts the config it ships.
3. Rows are inserted, sampled and re-prioritized through the published port; /metrics
   answers through its published port.
4. SIGTERM: the server drains, writes its checkpoint and exits 0.
5. A second container on the same volume restores every row; the ids issued before
   still name their rows (a priority update applies), new ids are fresh (never one
   issued before); it stops cleanly too.

Each step prints what it saw; any failure exits 1. Not part of `make test` (minutes); `.ci/run`
runs it on every change.
Environment: PODMAN, the podman command with its global flags.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

from replay_client import ReplayClient
from replay_server.app.config_file import load_settings

IMAGE = sys.argv[1] if len(sys.argv) > 1 else "localhost/replay-server:dev"
PODMAN = shlex.split(os.environ.get(
    "PODMAN", "podman --runtime runc --cgroup-manager cgroupfs --storage-driver vfs"))
NAME = f"replay-image-test-{os.getpid()}"
VOLUME = f"{NAME}-checkpoints"
STOP_TIMEOUT_S = 120
ROOT = Path(__file__).resolve().parents[2]
SHIPPED_CONFIG = ROOT / "deploy" / "image" / "replay.toml"  # the Dockerfile copies it in
RUN = ROOT / "deploy" / "image" / "run.sh"


def run(*args: str) -> str:
    """``podman run`` as the docs give it: deploy/image/run.sh, which adds the limits runc will
    set (docs/operations.md's podman line is that script's)."""
    result = subprocess.run([str(RUN), *args], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PODMAN": shlex.join(PODMAN)})
    if result.returncode != 0:
        raise AssertionError(f"deploy/image/run.sh {' '.join(args)} exited "
                             f"{result.returncode}:\n{result.stdout}{result.stderr}")
    return result.stdout.strip()


def podman(*args: str, check: bool = True, timeout: float = 300) -> str:
    result = subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited {result.returncode}:\n"
                             f"{result.stdout}{result.stderr}")
    return result.stdout.strip()


def logs(name: str) -> str:
    """The container's output (podman gives its stderr, where the server logs, on stderr)."""
    result = subprocess.run([*PODMAN, "logs", name], capture_output=True, text=True, timeout=60)
    return result.stdout + result.stderr


def step(text: str) -> None:
    print(f"\n== {text}", flush=True)


def ok(text: str) -> None:
    print(f"   ok: {text}", flush=True)


def expect(condition: bool, text: str) -> None:
    if not condition:
        raise AssertionError(text)
    ok(text)


def host_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "replay_server.app.cli", *args],
                          capture_output=True, text=True, timeout=60)


def start(name: str) -> tuple[str, str]:
    """Run a container of the image; returns its published gRPC and metrics addresses."""
    # read-only root as in deploy/k8s/statefulset.yaml: only the volume, /tmp and /dev/shm
    run("--detach", "--name", name, "--shm-size", "256m",
        "--read-only", "--read-only-tmpfs=false", "--tmpfs", "/tmp",
        "--volume", f"{VOLUME}:/var/lib/replay/checkpoints",
        "--publish", "127.0.0.1::50051", "--publish", "127.0.0.1::9100", IMAGE)
    grpc_address = podman("port", name, "50051/tcp").splitlines()[0]
    metrics_address = podman("port", name, "9100/tcp").splitlines()[0]
    ok(f"container {name}: gRPC on {grpc_address}, metrics on {metrics_address}")
    deadline = time.monotonic() + 180
    while True:
        health = host_cli("health", "--address", grpc_address, "--timeout", "3")
        if health.returncode == 0:
            break
        state = podman("inspect", name, "--format", "{{.State.Status}}")
        if state != "running" or time.monotonic() > deadline:
            print(logs(name))
            raise AssertionError(f"{name} never reported SERVING ({state}): {health.stdout}")
        time.sleep(1)
    expect("SERVING" in health.stdout,
           f"replay-server health --address {grpc_address} (from outside): "
           f"{health.stdout.strip()}")
    return grpc_address, metrics_address


def stop(name: str) -> str:
    """SIGTERM, wait for the exit; returns the container's log."""
    started = time.monotonic()
    podman("kill", "--signal", "TERM", name)
    code = podman("wait", name, timeout=STOP_TIMEOUT_S)
    log = logs(name)
    expect(code == "0", f"SIGTERM: exit status {code} after {time.monotonic() - started:.1f} s")
    return log


def main() -> int:
    step(f"image {IMAGE}")
    [config] = json.loads(podman("image", "inspect", IMAGE))
    settings = config["Config"]
    expect(settings.get("User") == "10001:10001",
           f"runs as user {settings.get('User')!r} (non-root)")
    healthcheck = podman("image", "inspect", IMAGE, "--format", "{{.HealthCheck}}")
    expect("replay-server health" in healthcheck, f"HEALTHCHECK: {healthcheck}")
    ports = sorted(settings.get("ExposedPorts", {}))
    expect(ports == ["50051/tcp", "9100/tcp"], f"exposes {ports}")
    expect("/var/lib/replay/checkpoints" in settings.get("Volumes", {}),
           f"volume {sorted(settings.get('Volumes', {}))}")
    print(f"   size: {int(config['Size']) / 1e9:.2f} GB")

    podman("volume", "create", VOLUME)
    try:
        return run_containers()
    finally:
        for name in (NAME, f"{NAME}-restored"):
            podman("rm", "--force", name, check=False)
        podman("volume", "rm", "--force", VOLUME, check=False)


def run_containers() -> int:
    step("first container: health, PID 1, user")
    address, metrics = start(NAME)
    healthcheck = subprocess.run([*PODMAN, "healthcheck", "run", NAME], capture_output=True,
                                 text=True, timeout=60)
    expect(healthcheck.returncode == 0,
           f"the image's HEALTHCHECK inside the container: exit {healthcheck.returncode} "
           f"{(healthcheck.stdout + healthcheck.stderr).strip() or 'healthy'}")
    pid1 = podman("exec", NAME, "cat", "/proc/1/cmdline").replace("\0", " ").strip()
    expect("replay-server serve" in pid1, f"PID 1 is the server: {pid1}")
    expect(podman("exec", NAME, "id", "-u") == "10001", "uid 10001")
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", (ROOT / "constraints.txt").read_text(),
                           re.MULTILINE))
    probe = ("import json; from importlib import metadata; print(json.dumps({n: "
             "metadata.version(n).split('+')[0] for n in ('torch', 'tensordict')}))")
    versions = json.loads(podman("exec", NAME, "/opt/replay/bin/python", "-c", probe))
    expect(versions == {n: pins[n] for n in versions},
           f"installed as constraints.txt pins: {versions}")
    checked = podman("exec", NAME, "replay-server", "check-config", "/etc/replay/replay.toml")
    expect(checked.startswith("/etc/replay/replay.toml: valid"),
           "replay-server check-config accepts the shipped config")

    step("insert, sample and update through the published port")
    client = ReplayClient(address, timeout=60)
    ids = client.insert("replay", {"obs": torch.randn(1000, 17),
                                   "action": torch.randint(4, (1000,)), "reward": torch.randn(1000)})
    first = int(ids[0])
    expect(ids.tolist() == list(range(first, first + 1000)), "1000 rows inserted, consecutive ids")
    with client.writer("slice") as writer:
        for episode in range(3):
            for t in range(40):
                writer.append({"obs": torch.randn(8), "done": t == 39})
            writer.end_episode()
    batch = client.sample("replay", 64)
    expect(tuple(batch.data["obs"].shape) == (64, 17), "sampled a batch of 64 x 17")
    applied = client.update_priorities("replay", batch.ids, torch.rand(64) + 0.1)
    expect(applied == 64, "64 priorities updated")
    slices = client.sample("slice", 4)
    expect(tuple(slices.data["obs"].shape) == (4, 32, 8), "sampled 4 slices of 32 steps")
    before = {name: table.size for name, table in client.info().items()}
    expect(before["replay"] == 1000 and before["slice"] == 120, f"sizes {before}")
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as response:
        text = response.read().decode()
    expect('replay_table_size_rows{table="replay"} 1000.0' in text,
           "/metrics through the published port shows the 1000 rows")
    info = host_cli("info", "--address", address)
    print("\n".join("   | " + line for line in info.stdout.splitlines()[:8]))
    client.close()

    step("SIGTERM: drain, checkpoint, exit 0")
    log = stop(NAME)
    for line in ("SIGTERM received: draining", "checkpoint (shutdown) written", "stopped"):
        expect(line in log, f"log: {line!r}")
    print("\n".join("   | " + line for line in log.splitlines() if "checkpoint" in line))

    step("second container on the same volume: restore")
    restored = f"{NAME}-restored"
    address, _ = start(restored)
    log = logs(restored)
    tables = len(load_settings(SHIPPED_CONFIG).tables)  # its [[tables]], or the default ones
    expect(f"restored {tables} table(s)" in log, f"log: restored {tables} table(s)")
    client = ReplayClient(address, timeout=60)
    info = host_cli("info", "--address", address)
    expect("restored at start from: /var/lib/replay/checkpoints/ckpt-" in info.stdout,
           "info names the checkpoint restored at start")
    after = {name: table.size for name, table in client.info().items()}
    expect(after == before, f"every row is back: {after}")
    expect(client.info()["replay"].counters["priority_updates"] == 64,
           "counters are back (64 priority updates)")
    expect(client.update_priorities("replay", ids[:8], torch.full((8,), 3.0)) == 8,
           "ids issued before the restart still name their rows")
    more = client.insert("replay", {"obs": torch.randn(2, 17), "action": torch.zeros(2,
                         dtype=torch.int64), "reward": torch.zeros(2)})
    expect(not set(more.tolist()) & set(ids.tolist()),
           f"new ids are fresh (never issued before): {more.tolist()}")
    expect(tuple(client.sample("slice", 2).data["obs"].shape) == (2, 32, 8),
           "slices sample after the restore")
    client.close()
    stop(restored)
    print("\nimage-test: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
