#!/usr/bin/env bash
# Builds kube-apiserver, kube-scheduler, kube-controller-manager and kubectl from
# the official k8s.io/kubernetes module into a per-user cache folder keyed by version,
# the way envtest provides its binaries; with --node, a simulated node's binaries instead:
# kubelet and crisim (the simulated container runtime), from node/.
#
# Usage: tools/controlplane/build.sh [--node] [MINOR]
#   MINOR  a supported Kubernetes minor, e.g. 1.32; default: the newest (go.mod).
#          go.mod pins the newest release; versions/v<MINOR>.mod (+ .sum) pins each older
#          one, built with -modfile from the same cmd/ mains.
#   --node the node binaries are built with the same module file plus node/modules/v<MINOR>.mod
#          (+ .sum): what kubelet needs beyond the control plane, kept apart so that adding
#          the node changes neither the control plane's module files nor its cached build.
# Env:   CD_CACHE_DIR  cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/computedomains)
# Prints the binaries directory on the last line of stdout; build output goes to stderr.
# Idempotent: returns at once when the binaries are already there (and were built
# from the current module file, its sums and the cmd sources).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
target=controlplane
binaries=(kube-apiserver kube-scheduler kube-controller-manager kubectl)
mains=cmd
if [[ "${1:-}" == "--node" ]]; then
    shift
    target=node
    binaries=(kubelet crisim)
    mains=node
fi

k8s_version_of() {
    awk '$1 == "k8s.io/kubernetes" && $2 ~ /^v/ {print $2; exit}' "$1"
}

minor_of() {
    local v="${1#v}"
    echo "${v%.*}"
}

newest="$(k8s_version_of "$here/go.mod")"
if [[ -z "$newest" ]]; then
    echo "build.sh: cannot find the k8s.io/kubernetes version in $here/go.mod" >&2
    exit 1
fi
wanted="${1:-}"
wanted="${wanted#v}"
if [[ $# -gt 1 || ( -n "$wanted" && ! "$wanted" =~ ^1\.[0-9]+$ ) ]]; then
    echo "build.sh: usage: build.sh [--node] [MINOR] (e.g. 1.32); got '$*'" >&2
    exit 2
fi

if [[ -z "$wanted" || "$wanted" == "$(minor_of "$newest")" ]]; then
    modfile="go.mod"
    sumfile="go.sum"
else
    modfile="versions/v$wanted.mod"
    sumfile="versions/v$wanted.sum"
    if [[ ! -f "$here/$modfile" ]]; then
        supported="$(minor_of "$newest")"
        for f in "$here"/versions/v*.mod; do
            [[ -f "$f" ]] && supported+=" $(basename "$f" .mod | tr -d v)"
        done
        echo "build.sh: Kubernetes $wanted is not supported (supported minors: $supported)" >&2
        exit 2
    fi
fi
k8s_version="$(k8s_version_of "$here/$modfile")"
if [[ -z "$k8s_version" ]]; then
    echo "build.sh: cannot find the k8s.io/kubernetes version in $here/$modfile" >&2
    exit 1
fi

extra_mod=()
if [[ "$target" == node ]]; then
    overlay="node/modules/v$(minor_of "$k8s_version")"
    if [[ ! -f "$here/$overlay.mod" || ! -f "$here/$overlay.sum" ]]; then
        echo "build.sh: $overlay.mod and .sum are missing: the node binaries of $k8s_version need them (go mod tidy with node/ shows what)" >&2
        exit 1
    fi
    extra_mod=("$overlay.mod" "$overlay.sum")
fi

cache_root="${CD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/computedomains}"
parent="$cache_root/$target"
dest="$parent/$k8s_version"

# Our own sources (module files, sums, the mains) are stamped into the result, so an edit
# to them rebuilds even though the folder is named by the Kubernetes version only.
source_hash="$(cd "$here" && cat "$modfile" "$sumfile" "${extra_mod[@]}" $(find "$mains" -name '*.go' | LC_ALL=C sort) | sha256sum | cut -d' ' -f1)"
stamp=".source-sha256"

complete() {
    local b
    for b in "${binaries[@]}"; do
        [[ -x "$dest/$b" ]] || return 1
    done
    [[ "$(cat "$dest/$stamp" 2>/dev/null)" == "$source_hash" ]]
}

if complete; then
    echo "$dest"
    exit 0
fi

if ! command -v go >/dev/null 2>&1; then
    echo "build.sh: 'go' is not on PATH; install Go >= 1.26 to build the Kubernetes $target binaries ($k8s_version)" >&2
    exit 1
fi

mkdir -p "$parent"
# Serialise concurrent builders (parallel test sessions); the second one finds the result.
exec 9>"$parent/.$k8s_version.lock"
if command -v flock >/dev/null 2>&1; then
    flock 9
fi
if complete; then
    echo "$dest"
    exit 0
fi

tmp="$(mktemp -d "$parent/.build-$k8s_version.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

# Stamp the release into the binaries as upstream's build does (kubectl version, /version).
major="${k8s_version#v}"; major="${major%%.*}"
minor="${k8s_version#v*.}"; minor="${minor%%.*}"
build_date="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $pkg.gitVersion=$k8s_version -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
    ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$build_date"
done

build_modfile="$modfile"
if [[ "$target" == node ]]; then
    # The module file go builds with: the control plane's plus the node's overlay (go reads
    # the sums from the file next to it, so both go into a folder of their own).
    mkdir "$tmp/.modfile"
    build_modfile="$tmp/.modfile/node.mod"
    cat "$here/$modfile" "$here/${extra_mod[0]}" > "$build_modfile"
    cat "$here/$sumfile" "$here/${extra_mod[1]}" > "$tmp/.modfile/node.sum"
fi

echo "build.sh: building Kubernetes $k8s_version $target binaries into $dest (takes a while the first time)" >&2
start=$SECONDS
(
    cd "$here"
    # The tag k8s_1_<minor> lets a main follow an API that changed between releases.
    GOWORK=off CGO_ENABLED=0 go build -mod=readonly -modfile="$build_modfile" -trimpath -tags="k8s_1_$minor" \
        -ldflags="$ldflags" -o "$tmp/" "./$mains/..."
    if [[ "$target" == node ]]; then
        # crisim's own rules (exit rule, CDI resolution); a few seconds on a warm cache.
        GOWORK=off CGO_ENABLED=0 go test -mod=readonly -modfile="$build_modfile" -trimpath -tags="k8s_1_$minor" \
            -count=1 ./node/crisim
    fi
) >&2
rm -rf "$tmp/.modfile"

for b in "${binaries[@]}"; do
    if [[ ! -x "$tmp/$b" ]]; then
        echo "build.sh: go build did not produce $b" >&2
        exit 1
    fi
done

# A leftover incomplete folder cannot exist (we only ever rename a finished one in),
# but clear anything in the way so the rename is the single commit point.
echo "$source_hash" > "$tmp/$stamp"
chmod 755 "$tmp"
rm -rf "$dest"
mv "$tmp" "$dest"
trap - EXIT
echo "build.sh: built Kubernetes $k8s_version $target binaries in $((SECONDS - start)) s" >&2
echo "$dest"
