#!/usr/bin/env bash
# Build the etcd server from the official Go module (pinned in go.mod) into a
# per-user cache folder keyed by version, as envtest does for its binaries.
# Idempotent: returns at once when the binary is already cached. The last line
# on stdout is the path of the etcd binary.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
version="$(awk '$1 == "require" && $2 == "go.etcd.io/etcd/server/v3" {print $3}' "$here/go.mod")"
if [ -z "$version" ]; then
  version="$(awk '$1 == "go.etcd.io/etcd/server/v3" {print $2}' "$here/go.mod")"
fi
cache="${CD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/computedomains}/etcd/$version"
if [ -x "$cache/etcd" ]; then
  echo "$cache/etcd"
  exit 0
fi
if ! command -v go >/dev/null 2>&1; then
  echo "error: building etcd needs Go (https://go.dev/dl); 'go' is not on PATH" >&2
  exit 1
fi
echo "building etcd $version into $cache (once; takes a few minutes)" >&2
mkdir -p "$cache"
tmp="$(mktemp -d "$cache/.build.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
(cd "$here" && go build -trimpath -ldflags='-s -w' -o "$tmp/etcd" .)
mv "$tmp/etcd" "$cache/etcd"
echo "$cache/etcd"
