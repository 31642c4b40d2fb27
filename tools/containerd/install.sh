#!/usr/bin/env bash
# Install what the containerd nodes (tools/containerd) take from Debian, once: runc, and the CNI
# plugins (containernetworking-plugins: bridge, host-local, loopback in /usr/lib/cni). Neither
# package has a service, so nothing starts. containerd itself is built from its module
# (tools/containerd/build.sh).
#
# Idempotent: returns at once when both are there. Needs apt-get (Debian or Ubuntu) and root or sudo.
set -euo pipefail

missing=()
command -v runc >/dev/null 2>&1 || missing+=(runc)
for plugin in bridge host-local loopback; do
  if [ ! -x "/usr/lib/cni/$plugin" ]; then
    missing+=(containernetworking-plugins)
    break
  fi
done
if [ "${#missing[@]}" -eq 0 ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "error: the containerd nodes need ${missing[*]}; install them with your package manager" >&2
  exit 1
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo >/dev/null 2>&1; then
    echo "error: installing ${missing[*]} needs root; run: apt-get install -y --no-install-recommends ${missing[*]}" >&2
    exit 1
  fi
  sudo="sudo"
fi
echo "installing Debian's ${missing[*]} for the containerd nodes (once)" >&2
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
command -v runc >/dev/null 2>&1 || { echo "error: runc is still not on PATH after apt-get install" >&2; exit 1; }
[ -x /usr/lib/cni/bridge ] || { echo "error: /usr/lib/cni/bridge is still missing after apt-get install" >&2; exit 1; }
