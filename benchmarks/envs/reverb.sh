#!/usr/bin/env bash
# Creates the Reverb virtualenv used by the service benchmark's Reverb side
# (benchmarks/reverb_service.py). Usage: benchmarks/envs/reverb.sh [VENV_DIR]
# VENV_DIR defaults to .venv-reverb at the repository root. Idempotent: does
# nothing when the venv already imports reverb and a server/client round trip
# works.
#
# dm-reverb 0.14.0 (the last release) ships cp311 manylinux2014 wheels only up
# to Python 3.11, and its [tensorflow] extra pins tensorflow~=2.15.0, which in
# turn needs numpy<2 and protobuf<5 (Reverb's own pybind extension is built
# against TF 2.15's C++ ABI, so a newer TF makes `import reverb` fail).
# The full tensorflow 2.15 wheel is CPU+GPU in one (~600 MB installed); no CUDA
# wheels are pulled.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${1:-.venv-reverb}"
case "$VENV" in
  /*) ;;
  *) VENV="$REPO_ROOT/$VENV" ;;
esac

PYTHON="${PYTHON:-python3.11}"
if ! command -v "$PYTHON" >/dev/null 2>&1; then
  echo "reverb.sh: $PYTHON not found; dm-reverb 0.14.0 has wheels for Python <= 3.11 only" >&2
  exit 1
fi

REVERB_VERSION="0.14.0"

check() {
  "$VENV/bin/python" - <<'PY' >/dev/null 2>&1
import os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tempfile
import numpy as np
import reverb
with tempfile.TemporaryDirectory() as ckpt:
    server = reverb.Server(tables=[reverb.Table(
        name="t", sampler=reverb.selectors.Prioritized(0.6),
        remover=reverb.selectors.Fifo(), max_size=16,
        rate_limiter=reverb.rate_limiters.MinSize(1))], port=None,
        checkpointer=reverb.checkpointers.DefaultCheckpointer(ckpt))
    try:
        client = reverb.Client(f"127.0.0.1:{server.port}")
        client.insert([np.arange(4, dtype=np.float32)], priorities={"t": 1.0})
        s = list(client.sample("t", num_samples=1))
        assert s and s[0][0].info.key
        client.mutate_priorities("t", updates={s[0][0].info.key: 2.0})
    finally:
        server.stop()
import psutil
PY
}

if [ -x "$VENV/bin/python" ] && check; then
  echo "reverb venv ready at $VENV (skipping install)"
  exit 0
fi

start=$(date +%s)
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# One resolver run with every pin, so nothing drifts: tensorflow 2.15 itself
# declares numpy<2 and protobuf<5, pinned here too so a resolver change
# cannot pick numpy 2 / protobuf 5 (both break tf 2.15 and reverb at import).
"$VENV/bin/python" -m pip install \
  "dm-reverb[tensorflow]==$REVERB_VERSION" \
  "tensorflow~=2.15.0" \
  "numpy>=1.23.5,<2" \
  "protobuf>=3.20.3,<5" \
  psutil

if ! check; then
  echo "reverb venv at $VENV installed but a Reverb server/client round trip fails:" >&2
  "$VENV/bin/python" -c "import reverb" || true
  exit 1
fi
"$VENV/bin/python" - <<'PY'
import os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
from importlib.metadata import version
print(" ".join(f"{p} {version(p)}" for p in
               ("dm-reverb", "tensorflow", "numpy", "protobuf", "dm-tree", "psutil")))
PY
echo "reverb venv ready at $VENV in $(( $(date +%s) - start )) s ($(du -sh "$VENV" | cut -f1))"
