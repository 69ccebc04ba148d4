#!/usr/bin/env bash
# Quickstart (a): install, start the local stack (Triton + gateway), drive the demo
# workload through the gateway with unmodified tritonclient, print the summary, stop.
# `--replicas N`: the same workload on N gateway replicas sharing one Redis (started here,
# on a free port) in front of one Triton (orchid_tools/fleet_demo.py; docs/operators.md
# "Running a fleet").
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
for arg in "$@"; do
  case "$arg" in
    --replicas | --replicas=*) exec .venv/bin/python -m orchid_tools.fleet_demo --config examples/orchid/gateway.yaml "$@" ;;
  esac
done
exec .venv/bin/orchid-gateway demo --config examples/orchid/gateway.yaml "$@"
