#!/usr/bin/env bash
# The docker compose CLI plugin (v2), built from its official Go module into a per-user cache
# folder keyed by version, as tools/helm/build.sh does for helm. Debian bookworm's docker-compose
# is the Python v1 (1.29), which cannot read docker-compose.yml (it has `depends_on: restart`).
# The folder holds `docker-compose` and nothing else: docker finds it through
# `cliPluginsExtraDirs` in the DOCKER_CONFIG the tests own (tools/containers/engine.py), so
# nothing is installed on the host.
#
# Usage: tools/containers/compose.sh [--cached-only]
# Env:   CD_CACHE_DIR  cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/computedomains)
# Prints the plugin folder on the last line of stdout. Idempotent.
set -euo pipefail

version=v2.40.3
module=github.com/docker/compose/v2
dest="${CD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/computedomains}/compose/$version"
if [[ -x "$dest/docker-compose" ]]; then
    echo "$dest"
    exit 0
fi
if [[ "${1:-}" == "--cached-only" ]]; then
    echo "compose.sh: docker compose $version is not built (run 'make setup-containers')" >&2
    exit 1
fi
if ! command -v go >/dev/null 2>&1; then
    echo "building docker compose needs Go (https://go.dev/dl); 'go' is not on PATH" >&2
    exit 1
fi
mkdir -p "$(dirname "$dest")"
exec 9>"$dest.lock"
flock 9
if [[ ! -x "$dest/docker-compose" ]]; then
    echo "building docker compose $version into $dest (once)" >&2
    tmp="$(mktemp -d "$dest.build.XXXXXX")"
    trap 'chmod -R u+w "$tmp" 2>/dev/null; rm -rf "$tmp"' EXIT
    # Built inside its own module (`go install pkg@version` refuses a go.mod with exclude
    # directives, as compose's has): the module's source from the module proxy, its go.sum
    # checking every dependency. The version stamp is what `docker compose version` shows.
    src="$(go mod download -json "$module@$version" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
    cp -r "$src" "$tmp/src"
    chmod -R u+w "$tmp/src"
    (cd "$tmp/src" && CGO_ENABLED=0 go build -trimpath -o "$tmp/docker-compose" \
        -ldflags="-s -w -X $module/internal.Version=$version" ./cmd) >&2
    rm -rf "$tmp/src"
    mv "$tmp" "$dest"
    trap - EXIT
fi
exec 9>&-
echo "$dest"
