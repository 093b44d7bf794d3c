"""deploy/image/limits.sh: the ``--ulimit`` flags the container scripts pass.

runc cannot raise a limit above its caller's (rootless podman, or podman inside another
container), so ``podman run`` with podman's own defaults fails there with ``error setting
rlimit type 7``. The flags must ask for exactly the caller's soft limits, nproc capped at
kernel.pid_max; docs/operations.md's podman line and `make image-test` both go through
deploy/image/run.sh, which adds them.
"""

from __future__ import annotations

import resource
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _flags(preamble: str = "") -> list[str]:
    script = f'{preamble}source deploy/image/limits.sh; printf "%s\\n" "${{ULIMITS[@]}}"'
    result = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True,
                            timeout=30, check=True)
    return result.stdout.split()


def _pid_max() -> int:
    return int(Path("/proc/sys/kernel/pid_max").read_text())


def test_the_flags_are_the_callers_own_soft_limits() -> None:
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    nproc = _pid_max() if nproc == resource.RLIM_INFINITY else min(nproc, _pid_max())
    assert _flags() == ["--ulimit", f"nofile={nofile}:{nofile}",
                        "--ulimit", f"nproc={nproc}:{nproc}"]


def test_lowered_limits_are_followed_and_an_unlimited_nproc_is_capped() -> None:
    assert _flags("ulimit -n 512; ") == ["--ulimit", "nofile=512:512", "--ulimit",
                                         _flags()[3]]
    hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    if hard == resource.RLIM_INFINITY:
        assert _flags("ulimit -u unlimited; ")[3] == f"nproc={_pid_max()}:{_pid_max()}"
    assert _flags("ulimit -u 300; ")[3] == "nproc=300:300"


def test_the_docs_podman_line_and_the_image_test_use_run_sh() -> None:
    run_sh = (ROOT / "deploy" / "image" / "run.sh").read_text()
    assert 'source "$(dirname "$0")/limits.sh"' in run_sh and '"${ULIMITS[@]}"' in run_sh
    doc = (ROOT / "docs" / "operations.md").read_text()
    assert "\ndeploy/image/run.sh -d --name replay" in doc
    image_test = (ROOT / "deploy" / "image" / "image_test.py").read_text()
    assert "    run(\"--detach\"" in image_test and "podman(\"run\"" not in image_test
