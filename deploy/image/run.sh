#!/usr/bin/env bash
# `podman run` for the replay-server image, with the limits runc will set
# (deploy/image/limits.sh says why plain `podman run` can fail with
# `error setting rlimit type 7: operation not permitted`).
#
#   deploy/image/run.sh [podman run's flags] IMAGE [COMMAND...]
#
# docs/operations.md's podman line is this script's, and `make image-test` starts its
# containers through it.
# Environment: PODMAN (the podman command and its global flags; the default is `make image`'s,
# so the image it built is the one found).
set -euo pipefail
read -r -a PODMAN <<< "${PODMAN:-podman --runtime runc --cgroup-manager cgroupfs --storage-driver vfs}"
source "$(dirname "$0")/limits.sh"
exec "${PODMAN[@]}" run "${ULIMITS[@]}" "$@"
