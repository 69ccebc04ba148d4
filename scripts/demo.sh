#!/usr/bin/env bash
# Quickstart (a): install, start a Feast feature server over a copy of
# examples/orchid/features (in a temporary directory) and the local stack (Triton + gateway +
# job store), drive the five modes through the gateway at once (online and streaming requests
# with unmodified tritonclient; features: ranker requests whose user_id features the gateway
# reads from Feast and judges by the route's contract, user 7's stale and user 8's missing
# values refused; async requests and a JSONL batch through orchid.jobs.v1.Operations, with a
# progress bar), print a line per mode and the online detail, stop. Jobs are kept in
# examples/orchid/state/jobs: a batch cut short (kill -9) completes on the next run.
# --no-features skips the features mode (a machine without Feast; the report says so).
# Options pass through to `orchid-gateway demo` (--duration, --batch-items, --state-dir, ...).
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
