#!/usr/bin/env bash
# Install the Debian packages `make image` needs (buildah, mmdebstrap), only when missing.
# Idempotent: returns at once when both are on PATH. Needs apt-get (Debian or Ubuntu) and root or sudo.
set -euo pipefail

missing=()
command -v buildah >/dev/null 2>&1 || missing+=(buildah)
command -v mmdebstrap >/dev/null 2>&1 || missing+=(mmdebstrap)
if [ "${#missing[@]}" -eq 0 ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "error: building the image needs ${missing[*]}; install them with your package manager" >&2
  exit 1
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo >/dev/null 2>&1; then
    echo "error: installing ${missing[*]} needs root; run: apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
  sudo="sudo"
fi
echo "installing ${missing[*]} from Debian's packages for the image build (once)" >&2
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
for tool in "${missing[@]}"; do
  command -v "$tool" >/dev/null 2>&1 || { echo "error: $tool is still not on PATH after apt-get install" >&2; exit 1; }
done
