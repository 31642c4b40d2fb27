#!/usr/bin/env bash
# One-time, idempotent setup: a .venv with the pinned Python dependencies and
# the project installed in editable mode. Binaries (etcd, control plane) are
# built by their own scripts into the per-user cache.
#
# Usage: tools/setup.sh             the services' dependencies and the development tools (tests, lint)
#        tools/setup.sh --runtime   the services' dependencies only (what `make demo` runs)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

target='.[dev]'
case "${1:-}" in
  "") ;;
  --runtime) target='.' ;;
  *) echo "usage: tools/setup.sh [--runtime]" >&2; exit 2 ;;
esac

python="${PYTHON:-python3}"
if ! command -v "$python" >/dev/null 2>&1; then
  echo "error: $python not found; install Python >= 3.11" >&2
  exit 1
fi
if ! "$python" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
  echo "error: Python >= 3.11 is needed, found $("$python" --version 2>&1)" >&2
  exit 1
fi
if ! command -v go >/dev/null 2>&1; then
  echo "error: Go is needed to build etcd and the test control plane (https://go.dev/dl); 'go' is not on PATH" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -c constraints.txt -e "$target"
echo "python environment ready in .venv"
