#!/usr/bin/env bash
# Put a static etcd (CGO off, so it runs on any base's libc) in the image's build context as
# build/image/etcd, built from the pinned Go module in tools/etcd into the per-user cache (once).
# tools/image/build.sh calls it; before `docker compose up --build` or a docker/podman build,
# run it yourself. Needs Go. The last line on stdout is the staged binary's path.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cache="${CD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/computedomains}"

# A cache folder of its own: tools/etcd/build.sh's binary may be linked against the host's libc
# (cgo), which a container's libc need not match.
etcd="$(CD_CACHE_DIR="$cache/image-etcd" CGO_ENABLED=0 bash "$repo/tools/etcd/build.sh" | tail -n 1)"
if ! go version -m "$etcd" | grep -q 'CGO_ENABLED=0'; then
  echo "error: $etcd is not a static build (CGO_ENABLED=0); remove it and run this again" >&2
  exit 1
fi
mkdir -p "$repo/build/image"
cp "$etcd" "$repo/build/image/etcd.tmp"
mv "$repo/build/image/etcd.tmp" "$repo/build/image/etcd"
echo "$repo/build/image/etcd"
