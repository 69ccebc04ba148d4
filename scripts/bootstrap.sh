#!/usr/bin/env bash
# Install everything orchid-gateway needs into ./.venv (idempotent).
# Python 3.11 from the machine; pip packages (incl. the nvidia-pytriton wheel that
# ships tritonserver) from PyPI. Safe to run again: a no-op when up to date.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
if ! "$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)'; then
  echo "orchid-gateway needs Python 3.11 (found $("$PYTHON" --version 2>&1)); set PYTHON=/path/to/python3.11" >&2
  exit 2
fi
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.orchid-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e '.[dev,triton]'
  touch "$stamp"
fi
