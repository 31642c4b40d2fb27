#!/usr/bin/env bash
# buf (the protobuf linter and breaking-change checker), built from its official Go module
# into a per-user cache folder keyed by version, as tools/etcd/build.sh does for etcd.
# `make lint` runs it over protos/ (see protos/buf.yaml and tools/protolint.py).
#
# Usage: tools/buf/build.sh [--cached-only]
# Env:   CD_CACHE_DIR  cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/computedomains)
# Prints the binary's path on the last line of stdout. Idempotent.
set -euo pipefail

version=v1.75.0
dest="${CD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/computedomains}/buf/$version"
if [[ -x "$dest/buf" ]]; then
    echo "$dest/buf"
    exit 0
fi
if [[ "${1:-}" == "--cached-only" ]]; then
    echo "build.sh: buf $version is not built (run 'make setup')" >&2
    exit 1
fi
if ! command -v go >/dev/null 2>&1; then
    echo "build.sh: building buf needs Go (https://go.dev/dl); 'go' is not on PATH" >&2
    exit 1
fi
mkdir -p "$(dirname "$dest")"
exec 9>"$(dirname "$dest")/.$version.lock"
command -v flock >/dev/null 2>&1 && flock 9
if [[ -x "$dest/buf" ]]; then
    echo "$dest/buf"
    exit 0
fi
echo "building buf $version into $dest (once; takes a few minutes)" >&2
tmp="$(mktemp -d "$(dirname "$dest")/.build-$version.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
GOBIN="$tmp" CGO_ENABLED=0 go install -trimpath -ldflags='-s -w' "github.com/bufbuild/buf/cmd/buf@$version" >&2
rm -rf "$dest"
mkdir -p "$dest"
mv "$tmp/buf" "$dest/buf"
echo "$dest/buf"
