#!/usr/bin/env bash
# `make image-scheduler`: cd-scheduler's image (the chart's and the kustomize component's
# schedulerPlugin image) with buildah, without a registry: only the static cd-scheduler binary
# that integrations/scheduler-plugin/build.sh builds into the per-user cache, on an empty base,
# run as 65532 as the manifests do. The last line on stdout is the image's name.
#
# Environment: CD_SCHEDULER_IMAGE (the image's name, default
# localhost/computedomains-scheduler:dev).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
image="${CD_SCHEDULER_IMAGE:-localhost/computedomains-scheduler:dev}"

bash "$here/deps.sh"
binary="$(bash "$repo/integrations/scheduler-plugin/build.sh" | tail -n 1)/cd-scheduler"
# An empty base has no libc: the binary must not need one.
if ! go version -m "$binary" | grep -q 'CGO_ENABLED=0'; then
  echo "error: $binary is not a static build (CGO_ENABLED=0)" >&2
  exit 1
fi

container="$(buildah from scratch)"
trap 'buildah rm "$container" >/dev/null 2>&1 || true' EXIT
buildah copy --quiet --chmod 0755 "$container" "$binary" /usr/local/bin/cd-scheduler >/dev/null
buildah config --env PATH=/usr/local/bin --user 65532:65532 --workingdir / \
  --entrypoint '["cd-scheduler"]' --cmd '["--help"]' \
  --label org.opencontainers.image.title=cd-scheduler "$container"
buildah commit --quiet "$container" "$image" >/dev/null
echo "built $image" >&2
echo "$image"
