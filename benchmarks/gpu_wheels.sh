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
# was made for (it refuses older runtimes). tensordict and TorchRL are not fetched: their
# compiled parts must match the machine's torch (the check reports them missing and goes on).
#
#   benchmarks/gpu_wheels.sh [PYTHON_VERSION]      (default 3.12)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${1:-3.12}
PLATFORMS=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
           manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    PLATFORMS+=(--platform "$tag")
done
mkdir -p "$ROOT/.whl"
for wheel in grpcio==1.85.3 grpcio-health-checking==1.85.1 protobuf==7.36.2 lz4==4.4.5 \
             prometheus-client==0.26.0; do
    python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version "$PY" --implementation cp "${PLATFORMS[@]}" -d "$ROOT/.whl" "$wheel"
done
ls -l "$ROOT/.whl"
