#!/usr/bin/env bash
# Creates the TorchRL virtualenv used by the engine benchmark's TorchRL side
# (benchmarks/torchrl_engine.py). Usage: benchmarks/envs/torchrl.sh [VENV_DIR]
# VENV_DIR defaults to .venv-torchrl at the repository root. Idempotent: does
# nothing when the venv already imports torchrl and its PrioritizedSampler
# extension loads.
#
# TorchRL's PrioritizedSampler uses a compiled extension (torchrl._torchrl) that
# only loads with the torch it was built against: torchrl 0.14.1 needs torch 2.14.x.
# torch 2.14 from PyPI pulls several GB of CUDA wheels; that is expected.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${1:-.venv-torchrl}"
case "$VENV" in
  /*) ;;
  *) VENV="$REPO_ROOT/$VENV" ;;
esac

PYTHON="${PYTHON:-python3.11}"
if ! command -v "$PYTHON" >/dev/null 2>&1; then
  PYTHON=python3
fi

TORCH_VERSION="${TORCH_VERSION:-2.14.1}"
TORCHRL_VERSION="0.14.1"

check() {
  "$VENV/bin/python" - <<'PY' >/dev/null 2>&1
import torch
from tensordict import TensorDict
from torchrl.data import PrioritizedSampler, ReplayBuffer, LazyTensorStorage
rb = ReplayBuffer(storage=LazyTensorStorage(16),
                  sampler=PrioritizedSampler(max_capacity=16, alpha=0.6, beta=0.4),
                  batch_size=4)
rb.extend(TensorDict({"x": torch.arange(16.0)}, batch_size=[16]))
_, info = rb.sample(return_info=True)
rb.update_priority(info["index"], torch.ones(4))
PY
}

if [ -x "$VENV/bin/python" ] && check; then
  echo "torchrl venv ready at $VENV (skipping install)"
  exit 0
fi

start=$(date +%s)
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# torch first, pinned, so torchrl's resolver cannot pick another torch.
if ! "$VENV/bin/python" -m pip install "torch==$TORCH_VERSION"; then
  echo "torch==$TORCH_VERSION failed, trying torch==2.14.0" >&2
  TORCH_VERSION=2.14.0
  "$VENV/bin/python" -m pip install "torch==$TORCH_VERSION"
fi
# tensordict: torchrl 0.14.1's own requirement picks the matching release.
"$VENV/bin/python" -m pip install "torch==$TORCH_VERSION" "torchrl==$TORCHRL_VERSION" tensordict numpy psutil

if ! check; then
  echo "torchrl venv at $VENV installed but PrioritizedSampler does not work:" >&2
  "$VENV/bin/python" -c "import torchrl._torchrl" || true
  exit 1
fi
"$VENV/bin/python" -c "import torch, torchrl, tensordict; print('torch', torch.__version__, 'torchrl', torchrl.__version__, 'tensordict', tensordict.__version__)"
echo "torchrl venv ready at $VENV in $(( $(date +%s) - start )) s"
