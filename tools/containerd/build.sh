#!/usr/bin/env bash
# containerd, its runc shim (containerd-shim-runc-v2) and ctr, built from containerd's official Go
# module into a per-user cache folder keyed by version, as tools/containers/compose.sh builds
# docker compose. The real kubelets of the container end-to-end test run on it
# (tools/containerd/node.py); runc comes from Debian (tools/containers/install.sh).
#
# Static (CGO_ENABLED=0), without the snapshotters that need cgo or kernel features this machine
# does not offer (btrfs, devmapper, zfs): overlayfs and native remain.
#
# Usage: tools/containerd/build.sh [--cached-only]
# Env:   CD_CACHE_DIR  cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/computedomains)
# Prints the binaries' folder on the last line of stdout; build output goes to stderr. Idempotent.
set -euo pipefail

version=v2.4.2
module=github.com/containerd/containerd/v2
binaries=(containerd containerd-shim-runc-v2 ctr)
dest="${CD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/computedomains}/containerd/$version"

complete() {
    local b
    for b in "${binaries[@]}"; do
        [[ -x "$dest/$b" ]] || return 1
    done
}

if complete; then
    echo "$dest"
    exit 0
fi
if [[ "${1:-}" == "--cached-only" ]]; then
    echo "build.sh: containerd $version is not built (run 'make setup-containers')" >&2
    exit 1
fi
if ! command -v go >/dev/null 2>&1; then
    echo "build.sh: building containerd $version needs Go (https://go.dev/dl); 'go' is not on PATH" >&2
    exit 1
fi
mkdir -p "$(dirname "$dest")"
# Serialise concurrent builders (parallel test sessions); the second one finds the result.
exec 9>"$dest.lock"
flock 9
if ! complete; then
    echo "build.sh: building containerd $version into $dest (once)" >&2
    start=$SECONDS
    tmp="$(mktemp -d "$dest.build.XXXXXX")"
    trap 'chmod -R u+w "$tmp" 2>/dev/null; rm -rf "$tmp"' EXIT
    # Built inside its own module: its source from the module proxy, its go.sum checking every
    # dependency. The version stamp is what `containerd --version` and the CRI's Version show.
    src="$(go mod download -json "$module@$version" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
    if [[ -z "$src" ]]; then
        echo "build.sh: go mod download $module@$version printed no source folder" >&2
        exit 1
    fi
    cp -r "$src" "$tmp/src"
    chmod -R u+w "$tmp/src"
    (
        cd "$tmp/src"
        for b in "${binaries[@]}"; do
            CGO_ENABLED=0 go build -mod=readonly -trimpath -tags "no_btrfs no_devmapper no_zfs" \
                -ldflags="-s -w -X $module/version.Version=$version" -o "$tmp/bin/$b" "./cmd/$b"
        done
    ) >&2
    mv "$tmp/bin" "$dest"
    echo "build.sh: built containerd $version in $((SECONDS - start)) s" >&2
fi
exec 9>&-
echo "$dest"
