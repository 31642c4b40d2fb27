#!/usr/bin/env bash
# The image's base when no image registry is reachable: a Debian root filesystem built from
# Debian's packages with mmdebstrap (python3 of the suite, its venv module, CA certificates; no
# docs, man pages, locales, apt lists or caches), imported into buildah's local storage as
# localhost/computedomains-base:<suite>-<digest of this script>. Elsewhere the Dockerfile's default
# base (python:3.11-slim-bookworm) plays this part.
#
# Idempotent: returns at once when that image exists. The last line on stdout is its name.
# The mirror is the machine's own (tools/image/sources.py); without one, mmdebstrap's default.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
suite="${CD_IMAGE_SUITE:-bookworm}"
python="${PYTHON:-python3}"
packages="python3,python3-venv,ca-certificates"
digest="$(cat "$0" "$here/sources.py" | sha256sum | cut -c1-12)"
name="localhost/computedomains-base:$suite-$digest"

if buildah inspect --type image "$name" >/dev/null 2>&1; then
  echo "$name"
  exit 0
fi

mirrors=()
while IFS= read -r line; do
  [ -n "$line" ] && mirrors+=("$line")
done < <(cd "$repo" && "$python" -m tools.image.sources "$suite")
if [ "${#mirrors[@]}" -eq 0 ]; then
  echo "no Debian $suite entry in this machine's apt sources; mmdebstrap uses its default mirrors" >&2
fi

work="$(mktemp -d "${TMPDIR:-/var/tmp}/cd-image-base.XXXXXX")"
container=""
cleanup() {
  if [ -n "$container" ]; then buildah rm "$container" >/dev/null 2>&1 || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

echo "building the $suite base root filesystem with mmdebstrap (once): $packages" >&2
# merged-/usr by symlinks (as Debian's own images): the usrmerge package would bring in perl.
mmdebstrap --quiet --variant=apt --include="$packages" \
  --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
  --aptopt='APT::Install-Recommends "false"' \
  --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  --dpkgopt='path-exclude=/usr/share/doc/*' \
  --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  --dpkgopt='path-exclude=/usr/share/info/*' \
  "$suite" "$work/rootfs.tar" "${mirrors[@]}" >&2

container="$(buildah from scratch)"
buildah add --quiet "$container" "$work/rootfs.tar" / >/dev/null
buildah config \
  --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --env LANG=C.UTF-8 \
  --cmd python3 \
  --label "org.opencontainers.image.description=Debian $suite with python3, from mmdebstrap" \
  "$container"
buildah commit --quiet --rm "$container" "$name" >/dev/null
container=""
echo "$name"
