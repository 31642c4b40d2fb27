#!/usr/bin/env bash
# Build etcdctl and etcdutl from the official Go modules (pinned in go.mod, the server's version)
# into the per-user cache beside the etcd server. Idempotent: returns at once when both are
# cached. The last line on stdout is the directory holding both.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
version="$(awk '$1 == "go.etcd.io/etcd/etcdutl/v3" && $2 ~ /^v/ {print $2; exit}' "$here/go.mod")"
if [ -z "$version" ]; then
  echo "error: go.etcd.io/etcd/etcdutl/v3 is not pinned in $here/go.mod" >&2
  exit 1
fi
cache="${CD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/computedomains}/etcd/$version"
if [ -x "$cache/etcdctl" ] && [ -x "$cache/etcdutl" ]; then
  echo "$cache"
  exit 0
fi
if ! command -v go >/dev/null 2>&1; then
  echo "error: building etcdctl and etcdutl needs Go (https://go.dev/dl); 'go' is not on PATH" >&2
  exit 1
fi
echo "building etcdctl and etcdutl $version into $cache (once; takes a few minutes)" >&2
mkdir -p "$cache"
tmp="$(mktemp -d "$cache/.build.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
for tool in etcdctl etcdutl; do
  (cd "$here" && go build -trimpath -ldflags='-s -w' -o "$tmp/$tool" "go.etcd.io/etcd/$tool/v3")
  mv "$tmp/$tool" "$cache/$tool"
done
echo "$cache"
