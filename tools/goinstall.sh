# Sourced by the build scripts of Go tools cached per user (tools/buf/build.sh, tools/helm/build.sh,
# integrations/placement-go/build.sh); needs bash and Go.
#
# go_install_into DEST PKG@VERSION...
#   `go install` each package into a temporary folder beside DEST, then moves the folder to DEST
#   as a whole, so a build cut off half-way never leaves a partial DEST. Concurrent builders of
#   the same DEST are serialised; the later one finds DEST made and builds nothing.
go_install_into() {
    local dest="$1" tmp pkg
    shift
    if ! command -v go >/dev/null 2>&1; then
        echo "building $* needs Go (https://go.dev/dl); 'go' is not on PATH" >&2
        return 1
    fi
    mkdir -p "$(dirname "$dest")"
    exec 9>"$dest.lock"
    if command -v flock >/dev/null 2>&1; then flock 9; fi
    if [[ -d "$dest" ]]; then
        exec 9>&-
        return 0
    fi
    echo "building $* into $dest (once)" >&2
    tmp="$(mktemp -d "$dest.build.XXXXXX")"
    for pkg in "$@"; do
        if ! GOBIN="$tmp" CGO_ENABLED=0 go install -trimpath -ldflags='-s -w' "$pkg" >&2; then
            rm -rf "$tmp"
            exec 9>&-
            return 1
        fi
    done
    mv "$tmp" "$dest"
    exec 9>&-
}
