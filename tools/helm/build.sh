#!/usr/bin/env bash
# helm, built from its official Go module into a per-user cache folder keyed by version, as
# tools/buf/build.sh does for buf. The tests render deployments/helm/compute-domains with it and
# apply the result to the test control plane.
#
# Usage: tools/helm/build.sh [--cached-only]
# Env:   CD_CACHE_DIR  cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/computedomains)
# Prints the binary's path on the last line of stdout. Idempotent.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../goinstall.sh"

version=v4.3.1
dest="${CD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/computedomains}/helm/$version"
if [[ ! -x "$dest/helm" ]]; then
    if [[ "${1:-}" == "--cached-only" ]]; then
        echo "build.sh: helm $version is not built (run 'make setup')" >&2
        exit 1
    fi
    go_install_into "$dest" "helm.sh/helm/v4/cmd/helm@$version"
fi
echo "$dest/helm"
