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

PROTOC_GEN_GO=v1.36.12      # google.golang.org/protobuf, the runtime version go.mod requires
PROTOC_GEN_GO_GRPC=v1.6.2   # google.golang.org/grpc/cmd/protoc-gen-go-grpc

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
parent="${CD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/computedomains}/placement-go"
plugins="$parent/plugins-$PROTOC_GEN_GO-$PROTOC_GEN_GO_GRPC"
source_hash="$(cd "$here" && cat build.sh go.mod go.sum $(find cmd placementv1 -name '*.go' 2>/dev/null | sort) | sha256sum | cut -c1-16)"
dest="$parent/check-$source_hash"
mode="${1:-}"
cached_only=false
for arg in "$@"; do [[ "$arg" == "--cached-only" ]] && cached_only=true; done

plugins_ready() { [[ -x "$plugins/protoc-gen-go" && -x "$plugins/protoc-gen-go-grpc" ]]; }
check_ready() { [[ -x "$dest/placement-check" ]]; }

if plugins_ready && { [[ "$mode" == "--plugins-only" ]] || check_ready; }; then
    [[ "$mode" == "--plugins-only" ]] && echo "$plugins" || echo "$dest"
    exit 0
fi
if $cached_only; then
    echo "build.sh: the placement Go tools are not built (run 'make setup')" >&2
    exit 1
fi
if ! command -v go >/dev/null 2>&1; then
    echo "build.sh: building the Go protobuf plugins and placement-check needs Go (https://go.dev/dl); 'go' is not on PATH" >&2
    exit 1
fi

mkdir -p "$parent"
exec 9>"$parent/.lock"
command -v flock >/dev/null 2>&1 && flock 9

if ! plugins_ready; then
    echo "build.sh: protoc-gen-go $PROTOC_GEN_GO and protoc-gen-go-grpc $PROTOC_GEN_GO_GRPC into $plugins (once)" >&2
    tmp="$(mktemp -d "$parent/.plugins.XXXXXX")"
    GOBIN="$tmp" CGO_ENABLED=0 go install -trimpath -ldflags='-s -w' \
        "google.golang.org/protobuf/cmd/protoc-gen-go@$PROTOC_GEN_GO" >&2
    GOBIN="$tmp" CGO_ENABLED=0 go install -trimpath -ldflags='-s -w' \
        "google.golang.org/grpc/cmd/protoc-gen-go-grpc@$PROTOC_GEN_GO_GRPC" >&2
    rm -rf "$plugins"
    mv "$tmp" "$plugins"
fi
if [[ "$mode" == "--plugins-only" ]]; then
    echo "$plugins"
    exit 0
fi
if ! check_ready; then
    echo "build.sh: placement-check into $dest (once per source change)" >&2
    tmp="$(mktemp -d "$parent/.check.XXXXXX")"
    (cd "$here" && GOWORK=off CGO_ENABLED=0 go build -mod=readonly -trimpath -ldflags='-s -w' \
        -o "$tmp/placement-check" ./cmd/placement-check) >&2
    rm -rf "$dest"
    mv "$tmp" "$dest"
fi
echo "$dest"
