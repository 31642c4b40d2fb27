#!/usr/bin/env bash
# The Go side of the placement advisor's API, into a per-user cache folder keyed by the
# sources (as tools/cdi/build.sh does):
#   protoc-gen-go, protoc-gen-go-grpc   the Go protobuf and gRPC plugins, from the Go module
#                                       proxy at the versions named below; tools/protogen.py
#                                       runs them to generate placementv1/ (committed).
#   placement-check                     cmd/placement-check built against placementv1/.
#
# Usage: integrations/placement-go/build.sh [--plugins-only] [--cached-only]
# Env:   CD_CACHE_DIR  cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/computedomains)
# Prints the cache folder on the last line of stdout. Idempotent. --plugins-only builds just the
# plugins (the generator needs them before placementv1/ exists); --cached-only never builds.
set -euo pipefail

PROTOC_GEN_GO=v1.36.12      # google.golang.org/protobuf; go.mod holds the runtime at the control plane's pre-release of it
PROTOC_GEN_GO_GRPC=v1.6.2   # google.golang.org/grpc/cmd/protoc-gen-go-grpc

source "$(dirname "${BASH_SOURCE[0]}")/../../tools/goinstall.sh"

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
parent="${CD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/computedomains}/placement-go"
plugins="$parent/plugins-$PROTOC_GEN_GO-$PROTOC_GEN_GO_GRPC"
source_hash="$(cd "$here" && cat build.sh go.mod go.sum $(find cmd placementv1 -name '*.go' 2>/dev/null | sort) | sha256sum | cut -c1-16)"
dest="$parent/check-$source_hash"
plugins_only=false
cached_only=false
for arg in "$@"; do
    [[ "$arg" == "--plugins-only" ]] && plugins_only=true
    [[ "$arg" == "--cached-only" ]] && cached_only=true
done
not_built() {
    echo "build.sh: $1 is not built (run 'make setup')" >&2
    exit 1
}

if [[ ! -x "$plugins/protoc-gen-go-grpc" ]]; then
    $cached_only && not_built "protoc-gen-go/protoc-gen-go-grpc"
    go_install_into "$plugins" \
        "google.golang.org/protobuf/cmd/protoc-gen-go@$PROTOC_GEN_GO" \
        "google.golang.org/grpc/cmd/protoc-gen-go-grpc@$PROTOC_GEN_GO_GRPC"
fi
if $plugins_only; then
    echo "$plugins"
    exit 0
fi
if [[ ! -x "$dest/placement-check" ]]; then
    $cached_only && not_built "placement-check"
    echo "build.sh: placement-check into $dest (once per source change)" >&2
    tmp="$(mktemp -d "$parent/.check.XXXXXX")"
    (cd "$here" && GOWORK=off CGO_ENABLED=0 go build -mod=readonly -trimpath -ldflags='-s -w' \
        -o "$tmp/placement-check" ./cmd/placement-check) >&2
    rm -rf "$dest"
    mv "$tmp" "$dest"
fi
echo "$dest"
