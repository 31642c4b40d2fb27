#!/usr/bin/env bash
# Builds kube-apiserver, kube-scheduler, kube-controller-manager and kubectl from
# the official k8s.io/kubernetes module into a per-user cache folder keyed by version,
# the way envtest provides its binaries.
#
# Usage: tools/controlplane/build.sh [MINOR]
#   MINOR  a supported Kubernetes minor, e.g. 1.32; default: the newest (go.mod).
#          go.mod pins the newest release; versions/v<MINOR>.mod (+ .sum) pins each older
#          one, built with -modfile from the same cmd/ mains.
# Env:   CD_CACHE_DIR  cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/computedomains)
# Prints the binaries directory on the last line of stdout; build output goes to stderr.
# Idempotent: returns at once when the binaries are already there (and were built
# from the current module file, its sums and the cmd sources).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
binaries=(kube-apiserver kube-scheduler kube-controller-manager kubectl)

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
    echo "build.sh: usage: build.sh [MINOR] (e.g. 1.32); got '$*'" >&2
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

cache_root="${CD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/computedomains}"
parent="$cache_root/controlplane"
dest="$parent/$k8s_version"

# Our own sources (module file, sums, the mains) are stamped into the result, so an edit
# to them rebuilds even though the folder is named by the Kubernetes version only.
source_hash="$(cd "$here" && cat "$modfile" "$sumfile" $(find cmd -name '*.go' | LC_ALL=C sort) | sha256sum | cut -d' ' -f1)"
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
    echo "build.sh: 'go' is not on PATH; install Go >= 1.26 to build the Kubernetes control plane ($k8s_version)" >&2
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

echo "build.sh: building Kubernetes $k8s_version control plane into $dest (takes a while the first time)" >&2
start=$SECONDS
(
    cd "$here"
    GOWORK=off CGO_ENABLED=0 go build -mod=readonly -modfile="$modfile" -trimpath -ldflags="$ldflags" -o "$tmp/" ./cmd/...
) >&2

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
echo "build.sh: built Kubernetes $k8s_version in $((SECONDS - start)) s" >&2
echo "$dest"
