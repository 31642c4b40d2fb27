#!/usr/bin/env bash
# The CDI project's own checks, from its official Go module, into a per-user cache
# folder keyed by version (as tools/etcd/build.sh does for etcd):
#   cdi-check   built from tags.cncf.io/container-device-interface (version pinned in
#               go.mod): loads spec dirs with pkg/cdi as runtimes do (strict parse,
#               validation, device injection); see main.go.
#   schema/     schema.json, defs.json and testdata/ of the CDI JSON schema, copied from
#               the module at SCHEMA_VERSION below, fetched through the Go module proxy.
#
# Why two versions: since v1.0.0 the schema lives in its own module
# (tags.cncf.io/container-device-interface/schema), which the module proxy does not
# serve (no tagged versions), so v0.8.1, the newest release of the main module that
# still contains schema/, is the newest schema the proxy has. Its schema lacks what
# CDI 1.0/1.1 added (netDevices, intelRdt schemata, top-level containerEdits in
# schema.json); cdi-check at the latest release covers those.
#
# Usage: tools/cdi/build.sh [--cached-only]
# Env:   CD_CACHE_DIR  cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/computedomains)
# Prints the cache folder on the last line of stdout. Idempotent: returns at once when
# the folder is complete and was made from the current sources. With --cached-only it
# never builds: exit 1 (and nothing on stdout) when the folder is not ready.
set -euo pipefail

SCHEMA_VERSION=v0.8.1
module=tags.cncf.io/container-device-interface

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
version="$(awk '$1 == "'"$module"'" && $2 ~ /^v/ {print $2; exit}' "$here/go.mod")"
if [[ -z "$version" ]]; then
    echo "build.sh: cannot find the $module version in $here/go.mod" >&2
    exit 1
fi
parent="${CD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/computedomains}/cdi"
dest="$parent/$version"
# Our sources (this script names SCHEMA_VERSION) are stamped into the folder, so an
# edit to them remakes it although the folder is named by the module version only.
source_hash="$(cd "$here" && cat build.sh go.mod go.sum main.go | sha256sum | cut -d' ' -f1)"
stamp=".source-sha256"

complete() {
    [[ -x "$dest/cdi-check" && -f "$dest/schema/schema.json" && -f "$dest/schema/defs.json" ]] &&
        [[ "$(cat "$dest/$stamp" 2>/dev/null)" == "$source_hash" ]]
}

if complete; then
    echo "$dest"
    exit 0
fi
if [[ "${1:-}" == "--cached-only" ]]; then
    echo "build.sh: $dest is not ready (run 'make setup')" >&2
    exit 1
fi
if ! command -v go >/dev/null 2>&1; then
    echo "build.sh: fetching the CDI schema and building cdi-check needs Go (https://go.dev/dl); 'go' is not on PATH" >&2
    exit 1
fi

mkdir -p "$parent"
# Serialise concurrent builders (parallel test sessions); the second one finds the result.
exec 9>"$parent/.$version.lock"
if command -v flock >/dev/null 2>&1; then
    flock 9
fi
if complete; then
    echo "$dest"
    exit 0
fi

echo "build.sh: CDI schema $SCHEMA_VERSION and cdi-check $version into $dest (once)" >&2
tmp="$(mktemp -d "$parent/.build-$version.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
# `go mod download -json` prints the module's folder in the module cache (as JSON).
# The brace count keeps the "Dir" of the module itself, not of an "Error" object.
info="$(cd "$tmp" && GOFLAGS=-mod=mod go mod download -json "$module@$SCHEMA_VERSION")"
moddir="$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p' <<<"$info")"
if [[ -z "$moddir" || ! -f "$moddir/schema/schema.json" ]]; then
    echo "build.sh: go mod download $module@$SCHEMA_VERSION gave no schema/:" >&2
    echo "$info" >&2
    exit 1
fi
mkdir -p "$tmp/out/schema"
cp "$moddir/schema/schema.json" "$moddir/schema/defs.json" "$tmp/out/schema/"
cp -r "$moddir/schema/testdata" "$tmp/out/schema/"
chmod -R u+w "$tmp/out"
(cd "$here" && GOWORK=off CGO_ENABLED=0 go build -mod=readonly -trimpath -ldflags='-s -w' -o "$tmp/out/cdi-check" .) >&2
echo "$source_hash" >"$tmp/out/$stamp"
rm -rf "$dest"
mv "$tmp/out" "$dest"
echo "$dest"
