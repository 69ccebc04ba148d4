#!/usr/bin/env bash
# Quickstart (b): install, then lint, type-check and run the whole default test suite
# (integration tests start one real Triton for the session). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
export PATH="$PWD/.venv/bin:$PATH"
ruff check gateway orchid_tools tests bench
ruff format --check gateway orchid_tools tests bench
mypy
# Import contracts (pyproject [tool.importlinter]): the decision core imports no asyncio,
# grpc, time or runtime module; the runtime never imports the tools.
lint-imports
# The Prometheus alert rules (docs/prometheus/alerts.yaml) must load (Debian 'prometheus').
if command -v promtool >/dev/null 2>&1; then
  promtool check rules docs/prometheus/alerts.yaml
else
  echo "test.sh: promtool not found: alert rules not checked" >&2
fi
# The whole suite, scenario tests marked slow included (plain `pytest` skips those for a fast
# inner loop). pytest exits 5 when it collects nothing: that is a failure here too (set -e).
pytest -m "slow or not slow" "$@"
