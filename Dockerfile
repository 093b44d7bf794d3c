# replay-server: one server process per container. docs/operations.md says how to run it.
#
#   docker build -t replay-server .                                     # CPU torch
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#                -t replay-server:cuda .                                # CUDA torch
#   make image          # podman on a Debian base made locally (no registry needed)
#
# Build arguments:
#   BASE_IMAGE       any image with python3 (3.11+) and its venv module
#   TORCH_VERSION    the torch release to install
#   TORCH_INDEX_URL  where torch comes from; the CPU build by default. Empty: pip's
#                    configured index (and find-links: deploy/image/pip/, below)
#
# deploy/image/pip/ holds optional pip settings for the build (pip.conf: a proxy's CA
# bundle, a local wheel folder). It is mounted for the install step only, never copied
# into a layer. Empty by default; `make image` fills it from this machine's pip config.

ARG BASE_IMAGE=docker.io/library/python:3.11-slim-bookworm

FROM ${BASE_IMAGE}
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# One stage, and the sources never in a layer: they are bind-mounted for the install step
# and copied to a scratch folder there (the build writes into its source tree). Under
# podman's vfs storage driver every layer and every stage is a full copy of the file
# system, so a build stage whose venv is copied into a second one costs three copies of
# torch on disk at the peak; this costs two.
#
# A fixed non-root uid: learners in other containers that share /dev/shm with the
# server must run as the same user to map its shared-memory rings.
#
# torch first, from its own index (the CPU or CUDA build); then the package and the rest
# of its dependencies from PyPI, torch already satisfied, against constraints.txt: the
# versions `make test` ran with (tensordict, ...). Then what a server never loads leaves
# the venv: the packages' own test suites and torch's C++ headers and test binaries
# (about 250 MB).
RUN --mount=type=bind,source=.,target=/context \
    set -eu; \
    groupadd --gid 10001 replay; \
    useradd --uid 10001 --gid replay --home-dir /var/lib/replay --create-home \
        --shell /usr/sbin/nologin replay; \
    mkdir -p /var/lib/replay/checkpoints /etc/replay; \
    chown replay:replay /var/lib/replay/checkpoints; \
    if [ -f /context/deploy/image/pip/pip.conf ]; then \
        export PIP_CONFIG_FILE=/context/deploy/image/pip/pip.conf; \
    fi; \
    mkdir /tmp/src; \
    cp -r /context/pyproject.toml /context/README.md /context/constraints.txt \
        /context/proto /context/feed /context/server /context/client /tmp/src/; \
    python3 -m venv /opt/replay; \
    /opt/replay/bin/pip install --no-cache-dir --disable-pip-version-check \
        ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}"; \
    /opt/replay/bin/pip install --no-cache-dir --disable-pip-version-check \
        -c /tmp/src/constraints.txt /tmp/src; \
    rm -rf /tmp/src; \
    site=$(/opt/replay/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
    rm -rf "$site/torch/include" "$site/torch/test"; \
    find "$site" -depth -type d -name tests -path "$site/*/*" -exec rm -rf {} +; \
    /opt/replay/bin/replay-server --version; \
    /opt/replay/bin/python -c 'import torch, replay_server.engine, replay_client'
COPY deploy/image/replay.toml /etc/replay/replay.toml
ENV PATH=/opt/replay/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    REPLAY_HEALTH_ADDRESS=127.0.0.1:50051
USER 10001:10001
WORKDIR /var/lib/replay
# Checkpoints: restored at start, written on a timer, on request and at SIGTERM.
VOLUME ["/var/lib/replay/checkpoints"]
# gRPC (replay.v1.ReplayService and grpc.health.v1.Health), Prometheus /metrics.
EXPOSE 50051 9100
# replay-server is PID 1 and handles SIGTERM itself: it stops accepting, lets in-flight
# calls finish (--grace), writes a final checkpoint and exits 0. Give it time to:
# `docker stop -t 120`, compose's stop_grace_period, Kubernetes' terminationGracePeriodSeconds.
STOPSIGNAL SIGTERM
# With TLS on, point REPLAY_HEALTH_ADDRESS at server.health_address (plaintext, health only).
# The check starts a Python process that loads grpc only, never torch (a fraction of a
# second); the timeout leaves room for a loaded host.
HEALTHCHECK --interval=30s --timeout=30s --start-period=120s --retries=3 \
    CMD ["/bin/sh", "-c", "exec replay-server health --address \"$REPLAY_HEALTH_ADDRESS\" --timeout 5"]
ENTRYPOINT ["replay-server"]
CMD ["serve", "--config", "/etc/replay/replay.toml"]
