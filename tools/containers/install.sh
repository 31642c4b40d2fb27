#!/usr/bin/env bash
# Install the container engine the compose test and `make image-smoke` run on, from Debian's
# packages, once: docker.io (dockerd 20.10), with its dependencies containerd and runc.
# Nothing is started or enabled: the package's service is kept from starting during the install,
# and the tests start their own dockerd with its own root, socket and no iptables rules
# (tools/containers/engine.py). The docker client on PATH is used as is (any 20.10 or newer).
#
# Idempotent: returns at once when dockerd, containerd and runc are on PATH. Needs apt-get
# (Debian or Ubuntu) and root or sudo.
set -euo pipefail

missing=()
for tool in dockerd containerd runc docker; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if [ "${#missing[@]}" -eq 0 ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "error: the container tests need dockerd, containerd and runc (missing: ${missing[*]});" \
       "install docker with your package manager" >&2
  exit 1
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo >/dev/null 2>&1; then
    echo "error: installing docker.io needs root; run: apt-get install -y --no-install-recommends docker.io" >&2
    exit 1
  fi
  sudo="sudo"
fi
# Debian starts a package's service from its postinst unless policy-rc.d says no: a system dockerd
# would add iptables rules and the docker0 bridge. Where the machine has no policy, one that denies
# every start stands for the length of the install (image builds ship the same file).
policy=/usr/sbin/policy-rc.d
temporary_policy=""
if [ ! -e "$policy" ]; then
  temporary_policy="$policy"
  printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
  $sudo chmod 755 "$policy"
  trap '$sudo rm -f "$temporary_policy"' EXIT
fi
echo "installing Debian's docker.io (dockerd, containerd, runc) for the container tests (once)" >&2
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends docker.io >/dev/null
for tool in dockerd containerd runc docker; do
  command -v "$tool" >/dev/null 2>&1 || { echo "error: $tool is still not on PATH after apt-get install" >&2; exit 1; }
done
