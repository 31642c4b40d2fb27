#!/usr/bin/env bash
# Builds Kueue's manager (cmd/kueue of the module sigs.k8s.io/kueue at KUEUE_VERSION, fetched
# through the Go module proxy) and copies its CRDs (config/components/crd/bases) and webhook
# configurations (config/components/webhook/manifests.yaml) of the same module into a per-user
# cache folder keyed by that version, the way tools/controlplane/build.sh
# builds the control plane. Go's own module and build caches are the shared ones, so the
# Kubernetes packages Kueue shares with our other Go builds compile once.
#
# The cold build takes minutes (16 on two cores under a load of 20, module downloads included), so it is not part of `make setup`:
# `make kueue` calls it.
#
# Usage: integrations/kueue/build.sh [--cached-only]
# Env:   CD_CACHE_DIR  cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/computedomains)
# Prints the cache folder (kueue, crd/, webhook/) on the last line of stdout; build output goes to stderr.
# Idempotent: returns at once when the folder is complete and was made by this script as it is.
set -euo pipefail

KUEUE_VERSION=v0.17.0
module=sigs.k8s.io/kueue

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cached_only=false
[[ "${1:-}" == "--cached-only" ]] && cached_only=true

parent="${CD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/computedomains}/kueue"
dest="$parent/$KUEUE_VERSION"
# This script (which names the version and the flags) is stamped into the result, so an edit to
# it rebuilds although the folder is named by the version only.
source_hash="$(sha256sum "$here/build.sh" | cut -d' ' -f1)"
stamp=".source-sha256"

complete() {
    [[ -x "$dest/kueue" && -f "$dest/crd/kueue.x-k8s.io_workloads.yaml" && -f "$dest/webhook/manifests.yaml" ]] &&
        [[ "$(cat "$dest/$stamp" 2>/dev/null)" == "$source_hash" ]]
}

if complete; then
    echo "$dest"
    exit 0
fi
if $cached_only; then
    echo "build.sh: Kueue $KUEUE_VERSION is not built (run 'make kueue')" >&2
    exit 1
fi
if ! command -v go >/dev/null 2>&1; then
    echo "build.sh: 'go' is not on PATH; install Go >= 1.25 to build Kueue $KUEUE_VERSION" >&2
    exit 1
fi

mkdir -p "$parent"
# Serialise concurrent builders (parallel test sessions); the second one finds the result.
exec 9>"$parent/.$KUEUE_VERSION.lock"
if command -v flock >/dev/null 2>&1; then
    flock 9
fi
if complete; then
    echo "$dest"
    exit 0
fi

tmp="$(mktemp -d "$parent/.build-$KUEUE_VERSION.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

# `go mod download -json` prints the module's folder in the module cache (as JSON); the pattern
# keeps the "Dir" of the module itself, not of an "Error" object.
info="$(cd "$tmp" && GOWORK=off GOFLAGS=-mod=mod go mod download -json "$module@$KUEUE_VERSION")"
moddir="$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p' <<<"$info")"
webhooks="config/components/webhook/manifests.yaml"
if [[ -z "$moddir" || ! -f "$moddir/go.mod" || ! -d "$moddir/config/components/crd/bases" || ! -f "$moddir/$webhooks" ]]; then
    echo "build.sh: go mod download $module@$KUEUE_VERSION gave no module with config/components/crd/bases and $webhooks:" >&2
    echo "$info" >&2
    exit 1
fi

echo "build.sh: building Kueue $KUEUE_VERSION into $dest (takes minutes the first time)" >&2
start=$SECONDS
version_pkg="$module/pkg/version"
ldflags="-s -w -X $version_pkg.GitVersion=$KUEUE_VERSION -X $version_pkg.BuildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
# Built in place: the module's own go.mod and go.sum pin every dependency (-mod=readonly), and
# the module cache is read-only, which go build does not mind.
(cd "$moddir" && GOWORK=off GOFLAGS= CGO_ENABLED=0 go build -mod=readonly -trimpath -ldflags="$ldflags" -o "$tmp/kueue" ./cmd/kueue) >&2
if [[ ! -x "$tmp/kueue" ]]; then
    echo "build.sh: go build did not produce the Kueue manager" >&2
    exit 1
fi
mkdir "$tmp/crd" "$tmp/webhook"
cp "$moddir"/config/components/crd/bases/*.yaml "$tmp/crd/"
cp "$moddir/$webhooks" "$tmp/webhook/"
chmod -R u+w "$tmp/crd" "$tmp/webhook"
echo "$source_hash" >"$tmp/$stamp"
chmod 755 "$tmp"
rm -rf "$dest"
mv "$tmp" "$dest"
trap - EXIT
echo "build.sh: built Kueue $KUEUE_VERSION in $((SECONDS - start)) s" >&2
echo "$dest"
