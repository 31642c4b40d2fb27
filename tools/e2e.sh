#!/usr/bin/env bash
# End-to-end tests against a real Kubernetes control plane (what `make e2e` runs):
# tests/e2e (the ComputeDomain scenario on 8 simulated nodes, each running the upstream kubelet on
# a simulated container runtime, an IMEX agent and a kubelet plugin; isolation, controller
# restart, every kubelet plugin replaced under a Ready domain, CRD validation, real-kubelet
# behaviour, the kubelet shim against real kubelets), a smaller scenario on the oldest supported Kubernetes
# (1.32), and tests/k8s (the control plane itself). CD_K8S_MINOR=1.32 runs tests/e2e on 1.32.
#
# Usage: tools/e2e.sh [pytest arguments]      e.g. tools/e2e.sh -x -k isolation
# Env:   PYTHON        interpreter with the project installed (default .venv/bin/python)
#        CD_CACHE_DIR  where the Go-built binaries are cached (see tools/controlplane/build.sh)
#        CD_E2E_KEEP=1 keep the environment's directory (logs, node state) after the run
#
# The binaries are built (first run: many minutes) or found in the cache before pytest
# starts, so the build's progress is visible and no test timeout covers it.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-$root/.venv/bin/python}"
if [[ ! -x "$py" ]]; then
    echo "e2e.sh: $py not found; run 'make setup' first" >&2
    exit 1
fi

started=$SECONDS
bash tools/etcd/build.sh >/dev/null
bash tools/controlplane/build.sh >/dev/null
bash tools/controlplane/build.sh 1.32 >/dev/null  # the oldest supported release (test_oldest_kubernetes.py)
bash tools/controlplane/build.sh --node >/dev/null  # kubelet and crisim, the simulated nodes' binaries
bash tools/controlplane/build.sh --node 1.32 >/dev/null
built=$SECONDS
echo "e2e: binaries ready in $((built - started)) s" >&2

status=0
"$py" -m pytest -q tests/e2e tests/k8s "$@" || status=$?
echo "e2e: tests took $((SECONDS - built)) s (total $((SECONDS - started)) s)" >&2
exit "$status"
