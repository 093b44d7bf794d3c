# One-command set-up: every target creates .venv and installs what it needs, once.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
EXAMPLES_STAMP := $(VENV)/.examples-stamp
SETUP_LOG := $(VENV)/setup.log
PIP    := $(BIN)/python -m pip install --disable-pip-version-check --progress-bar off -c constraints.txt
PYTEST_ARGS ?=
# make test's worker processes (pytest-xdist); 0 runs the suite in this process.
TEST_WORKERS ?= 2

.PHONY: install proto serve lint test soak demo bench bench-engine bench-service bench-learner \
        bench-scaleout bench-starvation bench-gpu-table clean image image-test conformance \
        gpu-check

# One line per set-up step; what the step prints goes to $(SETUP_LOG), whose end is shown
# (with the whole log's path) only when the step fails.
setup_step = @printf '  %s\n' $(1); { $(2); } >> $(SETUP_LOG) 2>&1 || { tail -n 40 $(SETUP_LOG); \
	printf 'set-up step failed: %s (the whole log: %s)\n' $(1) $(SETUP_LOG); exit 1; }

$(STAMP): pyproject.toml constraints.txt proto/replay/v1/*.proto
	@printf 'setting up %s (the first time takes a minute or two; log: %s)\n' $(VENV) $(SETUP_LOG)
	@mkdir -p $(VENV) && : > $(SETUP_LOG)
	$(call setup_step,"virtualenv $(VENV)",$(PYTHON) -m venv $(VENV))
	$(call setup_step,"pip",$(BIN)/python -m pip install -q --disable-pip-version-check --upgrade pip)
	$(call setup_step,"replay-server and its test tools (torch: constraints.txt)",$(PIP) -e '.[test]')
	$(call setup_step,"protobuf code (proto/generate.py)",$(BIN)/python proto/generate.py)
	@touch $(STAMP)

# What `make demo` needs beyond the package: installed once, again only if pyproject.toml changes.
$(EXAMPLES_STAMP): $(STAMP) pyproject.toml constraints.txt
	$(call setup_step,"the demo's packages: gymnasium and matplotlib",$(PIP) -e '.[examples]')
	@touch $(EXAMPLES_STAMP)

# Regenerate proto/replay_proto/v1 from proto/replay/v1/*.proto.
proto: $(STAMP)
	$(BIN)/python proto/generate.py

install: $(STAMP)

# CONFIG=file.toml: your config; without it, the default tables, checkpointed in ./checkpoints.
serve: $(STAMP)
	$(BIN)/replay-server serve $(if $(CONFIG),--config $(CONFIG),--checkpoint-dir checkpoints)

# Pyflakes-level checks (undefined or unused names) and the type checker ([tool.mypy] in
# pyproject.toml: the four packages), before the suite.
lint: $(STAMP)
	$(BIN)/ruff check --quiet --select F,E9 .
	$(BIN)/mypy

# A test file is one unit of work for a worker (--dist loadfile): a module's tests run in order
# in one process, against the server its module fixture starts once.
test: $(STAMP) lint
	$(BIN)/python -m pytest -m "not slow" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

soak: $(STAMP)
	$(BIN)/python -m pytest -m slow $(PYTEST_ARGS)

# DQN on CartPole through a replay server (examples/dqn_cartpole): server, actors, learner,
# a progress bar, and dqn_cartpole.png (return against environment steps).
demo: $(EXAMPLES_STAMP)
	$(BIN)/python -m examples.dqn_cartpole $(DEMO_ARGS)

# Side-by-side benchmarks. The anchors live in their own virtualenvs
# (TorchRL needs torch 2.14.x for its compiled extension).
.venv-torchrl/.installed-stamp:
	bash benchmarks/envs/torchrl.sh .venv-torchrl
	touch $@

bench-engine: $(STAMP) .venv-torchrl/.installed-stamp
	$(BIN)/python benchmarks/engine.py --torchrl-python .venv-torchrl/bin/python

# Reverb (dm-reverb 0.14, TensorFlow) needs Python 3.11, numpy<2 and protobuf<5: its own venv.
.venv-reverb/.installed-stamp:
	bash benchmarks/envs/reverb.sh .venv-reverb
	touch $@

bench-service: $(STAMP) .venv-reverb/.installed-stamp
	$(BIN)/python benchmarks/service.py --reverb-python .venv-reverb/bin/python

# Batches delivered to a learner (gRPC, shared memory, in process) vs Reverb's dataset;
# DEVICE=cuda also measures host-to-device against a plain pinned copy.
bench-learner: $(STAMP) .venv-reverb/.installed-stamp
	$(BIN)/python benchmarks/learner.py --reverb-python .venv-reverb/bin/python $(if $(DEVICE),--device $(DEVICE),)

# A learner loop with a fixed step (DEVICE=cuda: a 2 ms and a 10 ms GPU kernel; else a host
# sleep) fed by each path, against the same loop on preloaded data: ratio and idle fraction.
bench-starvation: $(STAMP)
	$(BIN)/python benchmarks/starvation.py $(if $(DEVICE),--device $(DEVICE),)

# A device-resident table (device = "cuda") vs TorchRL's LazyTensorStorage(device=...) with a
# PrioritizedSampler: sample 256 Atari rows + priority update. Without DEVICE: CPU figures.
# The GPU path in one prepared run (benchmarks/gpu_check.py; docs/learner.md, "Checking a GPU
# machine"): no set-up step, since a GPU machine may have no package registry; it runs the
# project from source with .venv's Python where there is one, else python3 (a GPU machine's,
# with its torch). Report: $(GPU_CHECK_OUT)/report.md and report.json.
GPU_CHECK_OUT ?= gpu-check
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
gpu-check:
	$(GPU_PYTHON) benchmarks/gpu_check.py --out $(GPU_CHECK_OUT)

bench-gpu-table: $(STAMP) .venv-torchrl/.installed-stamp
	$(BIN)/python benchmarks/gpu_table.py --torchrl-python .venv-torchrl/bin/python $(if $(DEVICE),--device $(DEVICE),)

bench: bench-engine bench-service bench-learner

# TorchRL's own replay-buffer tests with its buffer classes swapped for RemoteReplayBuffer on
# real servers (docs/torchrl.md): TORCHRL_TESTS=<a copy of pytorch/rl's test/rb, 0.14 line>.
# TORCHRL_VENV: torch 2.14 + torchrl 0.14.1, made (or found ready) by benchmarks/envs/torchrl.sh;
# pytest, grpcio and protobuf go beside it in CONFORMANCE_SITE (pip --target), never into it.
TORCHRL_VENV     ?= .venv-torchrl
CONFORMANCE_SITE ?= .venv-conformance-site
conformance: $(STAMP)
	@test -n "$(TORCHRL_TESTS)" || { echo "make conformance TORCHRL_TESTS=<dir of pytorch/rl's test/rb>"; exit 2; }
	bash benchmarks/envs/torchrl.sh $(TORCHRL_VENV)
	test -f $(CONFORMANCE_SITE)/.installed-stamp || { \
	  $(TORCHRL_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps \
	    --target $(CONFORMANCE_SITE) pytest iniconfig pluggy pygments 'grpcio>=1.70' \
	    'grpcio-health-checking>=1.70' 'protobuf>=7.35.1' && touch $(CONFORMANCE_SITE)/.installed-stamp; }
	$(BIN)/python -m tests.conformance --tests $(TORCHRL_TESTS) --python $(TORCHRL_VENV)/bin/python \
	  --site $(CONFORMANCE_SITE) $(CONFORMANCE_ARGS)

# Aggregate insert/sample rows/s over 1, 2 and 4 shards (docs/scale-out.md); no anchor.
bench-scaleout: $(STAMP)
	$(BIN)/python benchmarks/scaleout.py

# The container image (Dockerfile), built with podman: no Docker daemon or registry needed
# (a Debian base is made with debootstrap; docs/operations.md, "Container"). The default
# flags suit hosts whose hybrid cgroups podman's default runtime (crun) refuses.
PODMAN ?= podman --runtime runc --cgroup-manager cgroupfs --storage-driver vfs
IMAGE  ?= localhost/replay-server:dev

image:
	PODMAN="$(PODMAN)" bash deploy/image/build.sh $(IMAGE)

# Builds, then runs the image for real: health from outside, inserts and samples through
# the published port, SIGTERM, and the checkpoint restored in a second container.
# Minutes, so not part of `make test`.
image-test: image $(STAMP)
	PODMAN="$(PODMAN)" $(BIN)/python deploy/image/image_test.py $(IMAGE)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
