#!/usr/bin/env bash
# Builds cd-scheduler (kube-scheduler of the pinned Kubernetes release with the
# ComputeDomainPlacement plugin compiled in, cmd/cd-scheduler) into a per-user cache folder keyed
# by that release, the way tools/controlplane/build.sh builds the control plane. go.mod is the
# control plane's module set plus the placement advisor's Go bindings (integrations/placement-go),
# so after the control plane's build most packages come from Go's build cache.
#
# Usage: integrations/scheduler-plugin/build.sh [--cached-only]
# Env:   CD_CACHE_DIR  cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/computedomains)
# Prints the binary's folder on the last line of stdout; build output goes to stderr. Idempotent:
# returns at once when the binary is there and was built from the current sources.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bindings="$here/../placement-go"
cached_only=false
[[ "${1:-}" == "--cached-only" ]] && cached_only=true

k8s_version="$(awk '$1 == "k8s.io/kubernetes" && $2 ~ /^v/ {print $2; exit}' "$here/go.mod")"
if [[ -z "$k8s_version" ]]; then
    echo "build.sh: cannot find the k8s.io/kubernetes version in $here/go.mod" >&2
    exit 1
fi
cache_root="${CD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/computedomains}"
parent="$cache_root/scheduler-plugin"
dest="$parent/$k8s_version"
stamp=".source-sha256"
source_hash="$(
    cd "$here" && cat go.mod go.sum $(find cmd gang placement -name '*.go' | LC_ALL=C sort) \
        "$bindings/go.mod" $(find "$bindings/placementv1" -name '*.go' | LC_ALL=C sort) | sha256sum | cut -d' ' -f1
)"

complete() {
    [[ -x "$dest/cd-scheduler" && "$(cat "$dest/$stamp" 2>/dev/null)" == "$source_hash" ]]
}

if complete; then
    echo "$dest"
    exit 0
fi
if $cached_only; then
    echo "build.sh: cd-scheduler $k8s_version is not built (run 'make setup-k8s')" >&2
    exit 1
fi
if ! command -v go >/dev/null 2>&1; then
    echo "build.sh: 'go' is not on PATH; install Go >= 1.26 to build cd-scheduler ($k8s_version)" >&2
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

# The release stamped in as tools/controlplane/build.sh does (kube-scheduler's /version).
major="${k8s_version#v}"; major="${major%%.*}"
minor="${k8s_version#v*.}"; minor="${minor%%.*}"
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $pkg.gitVersion=$k8s_version -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
    ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
done

echo "build.sh: building cd-scheduler ($k8s_version with the ComputeDomainPlacement plugin) into $dest" >&2
start=$SECONDS
(
    cd "$here"
    # The gang table's rules and the plugin's args first (seconds).
    GOWORK=off CGO_ENABLED=0 go test -mod=readonly -trimpath -tags="k8s_1_$minor" -count=1 ./gang ./placement
    # Same flags and tag as the control plane's build, so its compiled packages are reused.
    GOWORK=off CGO_ENABLED=0 go build -mod=readonly -trimpath -tags="k8s_1_$minor" \
        -ldflags="$ldflags" -o "$tmp/cd-scheduler" ./cmd/cd-scheduler
) >&2
echo "$source_hash" > "$tmp/$stamp"
chmod 755 "$tmp"
rm -rf "$dest"
mv "$tmp" "$dest"
trap - EXIT
echo "build.sh: built cd-scheduler $k8s_version in $((SECONDS - start)) s" >&2
echo "$dest"
