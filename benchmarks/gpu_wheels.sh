#!/usr/bin/env bash
# The wheels `make gpu-check` needs on a GPU machine that has torch with CUDA but no package
# registry (this project's lent device machines: Python 3.12, torch, grpcio, numpy, uvloop,
# pytest there; docs/learner.md, "Checking a GPU machine"). Downloads them for CPython 3.12
# on x86-64 Linux into .whl/ (ignored by git), to be carried and installed there with
#
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site make gpu-check
#
# grpcio and protobuf come too, at the versions the generated code in proto/replay_proto/v1
# was made for (it refuses older runtimes). TorchRL and tensordict (for the check's TorchRL
# device-table step) come only when asked for, at a version whose compiled parts match the
# machine's torch: TorchRL 0.N with tensordict 0.N for torch 2.N (torch 2.11: 0.12.0 and
# 0.12.4 ran on an H200 on 2026-11-28). Without them the check reports them missing and goes on.
#
#   benchmarks/gpu_wheels.sh [PYTHON_VERSION [TORCHRL_VERSION]]   (default 3.12, no TorchRL)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${1:-3.12}
TORCHRL=${2:-}
PLATFORMS=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
           manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    PLATFORMS+=(--platform "$tag")
done
mkdir -p "$ROOT/.whl"
WHEELS=(grpcio==1.85.3 grpcio-health-checking==1.85.1 protobuf==7.36.2 lz4==4.4.5
        prometheus-client==0.26.0)
if [[ -n "$TORCHRL" ]]; then  # TorchRL 0.N.x needs tensordict 0.N.x; tensordict's own needs
    minor=$(echo "$TORCHRL" | cut -d. -f2)
    WHEELS+=("torchrl==$TORCHRL" "tensordict>=0.$minor,<0.$((minor + 1))" pyvers orjson
             importlib_metadata)
fi
for wheel in "${WHEELS[@]}"; do
    python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version "$PY" --implementation cp "${PLATFORMS[@]}" -d "$ROOT/.whl" "$wheel"
done
ls -l "$ROOT/.whl"
