#!/usr/bin/env bash
# Quickstart (a): install, start the local stack (Triton + gateway), drive the demo
# workload through the gateway with unmodified tritonclient, print the summary, stop.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec .venv/bin/orchid-gateway demo --config examples/orchid/gateway.yaml "$@"
