# ComputeDomains in Python. Newcomers: `make demo` (the simulated NVL72 demo) and `make test`.
SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp
RUNTIME_STAMP := $(VENV)/.runtime-stamp
PYTEST_ARGS ?=
PLACEMENT_API := computedomain/placement/v1

.PHONY: setup setup-demo etcd setup-k8s setup-browser setup-containers test lint protos api-release demo e2e bench chaos chaos-k8s image image-scheduler image-smoke clean help

help:
	@echo "make demo   - set up, then run the simulated NVL72 demo (the main job)"
	@echo "make test   - set up, lint, run the whole test suite"
	@echo "make setup-demo - what the demo runs: .venv with the services' pinned Python deps, and etcd"
	@echo "make setup  - .venv, pinned Python deps, etcd (with etcdctl and etcdutl), the CDI schema/checker, the Go placement client, buf and helm (and the test control plane) built once into the cache"
	@echo "make bench  - every benchmark against its target: build/bench/results.json, docs/benchmarks.json and docs/benchmarks.md (BENCH_ARGS=--quick: CI smoke)"
	@echo "make chaos  - the 30-minute chaos soak (SEED=n to replay one)"
	@echo "make chaos-k8s - the 10-minute chaos soak in Kubernetes mode, real kubelets (SEED=n to replay one)"
	@echo "make kueue  - Kueue v0.17 places a ComputeDomain Job in one NVLink clique (builds Kueue once; docs/kueue.md)"
	@echo "make lint   - ruff (check, format) + mypy + generated-code check + buf lint/breaking"
	@echo "make protos - regenerate libs/gen from protos/"
	@echo "make image  - the OCI image with buildah, no registry needed (base from Debian packages; needs root)"
	@echo "make image-scheduler - cd-scheduler's image (the chart's schedulerPlugin.image), from the binary setup-k8s builds"
	@echo "make image-smoke - the built image runs a 2-node simulated job (docker run on a private engine, then buildah run)"
	@echo "make setup-containers - Debian's docker.io, the docker compose plugin (built once into the cache) and the image"
	@echo "make e2e-containers - kubelets on containerd v2.4.2 and runc run real pods of a ComputeDomain Job (not in make test)"

$(RUNTIME_STAMP): pyproject.toml constraints.txt tools/setup.sh
	bash tools/setup.sh --runtime
	touch $(RUNTIME_STAMP)

# The development tools on top of the services' dependencies (one pip at a time, also under -j).
$(STAMP): $(RUNTIME_STAMP)
	bash tools/setup.sh
	touch $(STAMP)

# Only what `make demo` runs: the services' Python dependencies and etcd (no buf, helm, Go
# placement client or CDI checker, which only the tests and lint use). On a fresh machine etcd
# compiles (about 110 s of CPU) while pip installs (mostly downloads), so neither waits for the
# other under `make -j2` (as `make demo` runs it).
setup-demo: $(RUNTIME_STAMP) etcd

etcd:
	@bash tools/etcd/build.sh >/dev/null

setup: $(STAMP) setup-demo
	@bash tools/etcd/build-ctl.sh >/dev/null
	@bash tools/cdi/build.sh >/dev/null
	@bash integrations/placement-go/build.sh >/dev/null
	@bash tools/buf/build.sh >/dev/null
	@bash tools/helm/build.sh >/dev/null

# The Kubernetes control planes for tests (kube-apiserver, scheduler, controller-manager, kubectl),
# built once from the official Go modules into the per-user cache: the newest supported release
# (the whole suite) and the oldest (a smaller e2e scenario); measured cold on the shared, loaded
# 2-core machine: 1.37.2 about 12 min, 1.32.13 about 19 min. Then each release's kubelet and crisim
# (the simulated nodes' binaries, `--node`), from the same module cache and build cache: ~1.7 min.
# Then cd-scheduler (kube-scheduler 1.37.2 with the ComputeDomainPlacement plugin,
# integrations/scheduler-plugin): the control plane's module set, so ~2 min on its build cache.
setup-k8s: setup
	@bash tools/controlplane/build.sh >/dev/null
	@bash tools/controlplane/build.sh 1.32 >/dev/null
	@bash tools/controlplane/build.sh --node >/dev/null
	@bash tools/controlplane/build.sh --node 1.32 >/dev/null
	@bash integrations/scheduler-plugin/build.sh >/dev/null

# Debian's Chromium for the dashboard's browser test (Playwright drives the system browser).
setup-browser:
	@bash tools/install_chromium.sh

# The container runtime of tests/compose and `make image-smoke`: Debian's docker.io (dockerd,
# containerd, runc; no service started or enabled), the docker compose plugin built from its Go
# module into the per-user cache (tools/containers), and the image (`make image`). Each test starts
# its own private dockerd (tools/containers/engine.py). Needs root.
setup-containers: image image-scheduler
	@bash tools/containers/install.sh
	@bash tools/containers/compose.sh >/dev/null

# Real containers (tests/e2e_containers): each node's kubelet on containerd v2.4.2 (built once from
# its module into the cache, tools/containerd/build.sh) with Debian's runc and CNI plugins, and the
# image's Debian base as the pods' image. Not part of `make test`: the cold containerd build alone
# takes about 9 minutes here (docs/containerd.md). Needs root.
.PHONY: e2e-containers
e2e-containers: setup setup-k8s
	@bash tools/containerd/install.sh
	@bash tools/containerd/build.sh >/dev/null
	@bash tools/image/deps.sh
	@bash tools/image/base.sh >/dev/null
	CD_CONTAINERS_E2E=1 $(PY) -m pytest -q --durations=5 tests/e2e_containers $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy libs services tools
	$(PY) -m tools.protogen --check
	@buf="$$(bash tools/buf/build.sh)"; cd protos && "$$buf" lint && \
		"$$buf" breaking --path $(PLACEMENT_API) --against released/placement-v1.binpb && echo "buf lint and buf breaking: clean"

# Record the placement API as released: `buf breaking` in make lint compares against this image.
api-release: setup
	@buf="$$(bash tools/buf/build.sh)"; cd protos && "$$buf" build --path $(PLACEMENT_API) -o released/placement-v1.binpb

protos: setup
	$(PY) -m tools.protogen

test: setup setup-k8s setup-browser setup-containers lint
	$(PY) -m pytest -q --durations=20 $(PYTEST_ARGS)

demo:
	@$(MAKE) --no-print-directory -j2 setup-demo
	PYTHON=$(PY) bash tools/demo.sh

# Kueue v0.17 with ComputeDomains (docs/kueue.md): Kueue's manager built once from its Go module into
# the cache (integrations/kueue/build.sh; cold: 16 min on the loaded 2-core machine), then
# tests/e2e/kueue on the real-kubelet environment (not part of `make test`, see pyproject.toml).
.PHONY: kueue
kueue: setup setup-k8s
	@bash integrations/kueue/build.sh >/dev/null
	$(PY) -m pytest -q --durations=5 tests/e2e/kueue $(PYTEST_ARGS)

# The Kubernetes end-to-end scenarios alone (also part of `make test`).
e2e: setup setup-k8s
	PYTHON=$(PY) bash tools/e2e.sh

# Every benchmark in simulation, against the targets in tools/bench/suite.py (~10 min; BENCH_ARGS=--quick for a <2 min smoke):
# figures to build/bench/results.json and docs/benchmarks.json (committed), the report to docs/benchmarks.md.
BENCH_ARGS ?=
bench: setup
	$(PY) -m tools.bench.run $(BENCH_ARGS)

# The chaos soak: random jobs and real faults for 30 minutes, invariants checked throughout.
# SEED=n replays a run (the seed is printed at the start and on failure).
SEED ?=
chaos: setup
	$(PY) -m tools.chaos --duration 1800 $(if $(SEED),--seed $(SEED))

# The chaos soak in Kubernetes mode: random ComputeDomain jobs through the API server on 6 real
# kubelets, under kubelet restarts, cd-node-agent kills, controller failovers, kube-apiserver
# restarts and lost nodes, for 10 minutes; the seed is printed first, the summary (faults by kind,
# jobs, checks, violations) goes to build/chaos-k8s.json. A short run is part of `make test`.
chaos-k8s: setup setup-k8s
	@mkdir -p build
	$(PY) -m tools.chaoskube --duration 600 --trays 6 --summary-json build/chaos-k8s.json $(if $(SEED),--seed $(SEED))

# The OCI image (Dockerfile) with buildah: installs buildah and mmdebstrap when missing, builds
# the Debian base with mmdebstrap and a static etcd, then the image (tools/image/build.sh).
# Needs root and the machine's container storage (see docs/operations.md); `make test` builds it for tests/compose.
image:
	PYTHON=$(PYTHON) bash tools/image/build.sh

# cd-scheduler's image (the chart's schedulerPlugin.image): the static binary of
# integrations/scheduler-plugin on an empty base, with buildah (tools/image/scheduler.sh; seconds
# once setup-k8s built the binary).
image-scheduler:
	@bash tools/image/scheduler.sh >/dev/null

# The services started from the image, one container each, and a 2-node job through them: under
# docker (a private engine, `docker run`), then under buildah (`buildah run --isolation chroot`).
image-smoke: setup setup-containers
	$(PY) -m tools.image.smoke --runtime docker
	$(PY) -m tools.image.smoke --runtime buildah

clean:
	rm -rf build .pytest_cache .mypy_cache .ruff_cache
