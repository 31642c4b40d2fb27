#!/usr/bin/env bash
# buf (the protobuf linter and breaking-change checker), built from its official Go module
# into a per-user cache folder keyed by version, as tools/etcd/build.sh does for etcd.
# `make lint` runs it over protos/ (rules in protos/buf.yaml).
#
# Usage: tools/buf/build.sh [--cached-only]
# Env:   CD_CACHE_DIR  cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/computedomains)
# Prints the binary's path on the last line of stdout. Idempotent.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../goinstall.sh"

version=v1.75.0
dest="${CD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/computedomains}/buf/$version"
if [[ ! -x "$dest/buf" ]]; then
    if [[ "${1:-}" == "--cached-only" ]]; then
        echo "build.sh: buf $version is not built (run 'make setup')" >&2
        exit 1
    fi
    go_install_into "$dest" "github.com/bufbuild/buf/cmd/buf@$version"
fi
echo "$dest/buf"
