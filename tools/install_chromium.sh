#!/usr/bin/env bash
# Install Debian's Chromium for the dashboard's browser tests (tests/dashboard), once.
# Idempotent: returns at once when a Chromium is already on PATH (or $CHROMIUM_BIN is set).
# Playwright drives this system browser; it never downloads one of its own.
set -euo pipefail

if [ -n "${CHROMIUM_BIN:-}" ] && [ -x "${CHROMIUM_BIN}" ]; then
  exit 0
fi
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "error: the dashboard tests need Chromium; install it with your package manager" \
       "or set CHROMIUM_BIN to a Chromium binary" >&2
  exit 1
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo >/dev/null 2>&1; then
    echo "error: installing chromium needs root (apt-get); run: apt-get install -y chromium" >&2
    exit 1
  fi
  sudo="sudo"
fi
echo "installing Debian's chromium for the dashboard tests (once)" >&2
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium >/dev/null
command -v chromium >/dev/null 2>&1 || { echo "error: chromium is still not on PATH" >&2; exit 1; }
