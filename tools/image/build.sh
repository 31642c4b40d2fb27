#!/usr/bin/env bash
# `make image`: build the project's OCI image with buildah, without an image registry.
#
#   1. buildah and mmdebstrap from Debian's packages, when missing (tools/image/deps.sh);
#   2. the base: Debian bookworm with python3.11 from mmdebstrap (tools/image/base.sh, cached);
#   3. etcd: a static binary (CGO off, so it runs on any base) built from the pinned Go module in
#      tools/etcd into the per-user cache, copied into the build context as build/image/etcd
#      (tools/image/etcd.sh);
#   4. buildah bud of ./Dockerfile with --build-arg BASE_IMAGE=<that base>; Python dependencies
#      from PyPI, pinned by constraints.txt.
#
# Environment: CD_IMAGE (the image's name, default localhost/computedomains:dev), CD_IMAGE_BASE
# (use this base instead of building one, e.g. python:3.11-slim-bookworm where a registry is
# reachable). The last line on stdout is the image's name.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
image="${CD_IMAGE:-localhost/computedomains:dev}"

bash "$here/deps.sh"

base="${CD_IMAGE_BASE:-}"
if [ -z "$base" ]; then
  base="$(bash "$here/base.sh" | tail -n 1)"
fi

bash "$here/etcd.sh" >/dev/null

# pip in the build trusts what this machine trusts (a TLS-inspecting egress proxy has its own CA).
ca="${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}"
secret=()
if [ -s "$ca" ]; then
  secret=(--secret "id=pip-ca,src=$ca")
fi

echo "building $image from $base" >&2
# --layers: a rebuild after a code change reuses the dependencies' layer.
buildah bud --quiet --isolation chroot --layers "${secret[@]}" \
  --build-arg "BASE_IMAGE=$base" \
  -f "$repo/Dockerfile" -t "$image" "$repo" >&2
echo "$image"
