#!/usr/bin/env bash
# `make image`: build the replay-server image with podman where there is no Docker
# daemon and no registry to pull a base image from (docs/operations.md, "Container").
#
#   deploy/image/build.sh [IMAGE]       (default localhost/replay-server:dev)
#
# 1. podman, runc and debootstrap are installed if missing (apt-get, as root).
# 2. The base image, a minimal Debian with python3 and its venv module, is made with
#    debootstrap and `podman import`ed once (localhost/replay-base:bookworm); the
#    Dockerfile's BASE_IMAGE points at it.
# 3. This machine's pip settings (`pip config list`: its CA bundle, and the torch wheel
#    from its local wheel folder) are copied into deploy/image/pip/ for the build.
# 4. podman builds the Dockerfile (docker format, so HEALTHCHECK is kept).
#
# Environment: PODMAN (the podman command and its global flags; the Makefile's default
# suits hosts whose hybrid cgroups crun refuses), DEBIAN_MIRROR, DEBIAN_SUITE,
# TORCH_VERSION.
set -euo pipefail

IMAGE=${1:-localhost/replay-server:dev}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
read -r -a PODMAN <<< "${PODMAN:-podman --runtime runc --cgroup-manager cgroupfs --storage-driver vfs}"
BASE=${BASE_IMAGE:-localhost/replay-base:bookworm}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
DEBIAN_SUITE=${DEBIAN_SUITE:-bookworm}
TORCH_VERSION=${TORCH_VERSION:-$(sed -n 's/^torch==//p' "$ROOT/constraints.txt")}
source "$ROOT/deploy/image/limits.sh"  # ULIMITS: the limits runc will set

step() { printf '\n== %s\n' "$*"; }

ensure_tools() {
    local missing=()
    command -v podman >/dev/null || missing+=(podman)
    command -v runc >/dev/null || missing+=(runc)
    command -v debootstrap >/dev/null || missing+=(debootstrap)
    [ ${#missing[@]} -eq 0 ] && return
    if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
        echo "build.sh: missing ${missing[*]}; install them (Debian: apt-get install ${missing[*]})" >&2
        exit 1
    fi
    step "installing ${missing[*]}"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
}

make_base() {
    if "${PODMAN[@]}" image exists "$BASE"; then
        echo "base image $BASE: present"
        return
    fi
    step "making the base image $BASE from Debian $DEBIAN_SUITE (debootstrap, about 2 minutes)"
    local rootfs
    rootfs=$(mktemp -d /tmp/replay-base.XXXXXX)
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        "$DEBIAN_SUITE" "$rootfs" "$DEBIAN_MIRROR" > "$rootfs.log" 2>&1 \
        || { tail -20 "$rootfs.log" >&2; exit 1; }
    rm -f "$rootfs.log"
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    chmod 755 "$rootfs"  # mktemp made it 0700: the image's / must be open to its non-root user
    tar -C "$rootfs" -c . | "${PODMAN[@]}" import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["python3"]' - "$BASE"
    rm -rf "$rootfs"
}

pip_setting() {  # the value of one `pip config list` key (global or environment), or nothing
    python3 -m pip config list 2>/dev/null \
        | sed -n "s/^\(global\|:env:\)\.$1='\(.*\)'$/\2/p" | tail -1
}

copy_pip_settings() {
    step "pip settings for the build (deploy/image/pip/)"
    local dir="$ROOT/deploy/image/pip" cert links wheel
    find "$dir" -mindepth 1 ! -name README.md -delete
    : > "$dir/pip.conf.new"
    echo "[global]" >> "$dir/pip.conf.new"
    cert=$(pip_setting cert)
    if [ -n "$cert" ] && [ -f "$cert" ]; then
        cp "$cert" "$dir/ca-bundle.crt"
        echo "cert = /context/deploy/image/pip/ca-bundle.crt" >> "$dir/pip.conf.new"
        echo "CA bundle: $cert"
    fi
    links=$(pip_setting find-links)
    wheel=$(ls "$links"/torch-"$TORCH_VERSION"+cpu-*.whl 2>/dev/null | head -1 || true)
    if [ -n "$wheel" ]; then
        mkdir -p "$dir/wheels"
        cp "$wheel" "$dir/wheels/"
        echo "find-links = /context/deploy/image/pip/wheels" >> "$dir/pip.conf.new"
        echo "torch wheel: $wheel"
        TORCH_INDEX_URL=""  # the local CPU wheel; everything else from PyPI
    else
        TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
    fi
    mv "$dir/pip.conf.new" "$dir/pip.conf"
}

ensure_tools
make_base
copy_pip_settings
step "building $IMAGE (base $BASE, torch $TORCH_VERSION)"
# The build needs about twice the image's size free (about 2.2 GB) where podman stores
# images: say how much there is, so that a full disk reads as one.
STORE=$("${PODMAN[@]}" info --format '{{.Store.GraphRoot}}' 2>/dev/null || echo /var/lib/containers)
mkdir -p "$STORE"
echo "free where podman stores images ($STORE): $(df -h --output=avail "$STORE" | tail -1 | tr -d ' ')"
cd "$ROOT"
# --layers=false: one commit per stage. With the vfs storage driver every layer is a full
# copy of the filesystem, so per-instruction layers would cost gigabytes and minutes.
"${PODMAN[@]}" build --format docker --layers=false --network host "${ULIMITS[@]}" \
    --build-arg "BASE_IMAGE=$BASE" --build-arg "TORCH_VERSION=$TORCH_VERSION" \
    --build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL" -t "$IMAGE" -f Dockerfile .
"${PODMAN[@]}" image prune --force > /dev/null  # the replaced image, if any
"${PODMAN[@]}" image ls "$IMAGE"
