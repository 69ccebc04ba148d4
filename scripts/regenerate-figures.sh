#!/usr/bin/env bash
# Regenerate every benchmark figure and every shipped simulator scenario's output at the
# checked-out commit, one after the other (each wants the machine to itself: run nothing else
# meanwhile). Each run's whole output goes to docs/bench-logs/<name>.txt under a header naming
# the commit, the time and the command; plots go where each script puts them (docs/img/).
# docs/benchmarks.md quotes these logs. About 30 minutes on the 2-core development machine.
#
#   scripts/regenerate-figures.sh            # everything
#   scripts/regenerate-figures.sh surge noisy-neighbour simulate-seed-surge   # some, by name
#
# Exit status: the number of runs that failed (a benchmark exits non-zero when a request
# failed or a target it checks was missed; `simulate --check` when an expectation failed).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
LOGS=docs/bench-logs
mkdir -p "$LOGS"
commit="$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- gateway orchid_tools bench policies routes examples || echo '+changes')"

declare -a NAMES=() COMMANDS=()
add() { NAMES+=("$1"); COMMANDS+=("$2"); }
add overhead "$PY bench/overhead.py"
add overhead-1-in-flight "$PY bench/overhead.py -c 1 -n 2000 --targets direct,passthrough,gateway"
# The same with the gateway's edge alone (no decision: bench/ablate.py): the floor a gateway on
# grpc.aio reaches at one request in flight, against issue 31's "p50 <= 1 ms above direct".
add overhead-1-in-flight-edge "$PY bench/overhead.py -c 1 -n 2000 --targets direct,passthrough,gateway --ablate decisions"
add request-path "$PY bench/request_path.py"
add policy-eval "$PY bench/policy_eval.py"
add surge-1.25x "$PY bench/surge.py"
add surge-normal-87pct "$PY bench/surge.py --targets gateway --kill-at 0 --sweep-s 0 --tuned-queue-size 16 --tuned-batching off --load-factor 0.893 --surge-s 0 --recover-s 0 --normal-s 60 --plot docs/img/surge-normal-87pct.png"
add noisy-neighbour "$PY bench/noisy_neighbour.py"
add rehearsal "$PY bench/rehearsal.py"
add rehearsal-bad-candidates "$PY bench/rehearsal.py --bad-candidates"
add replicas "$PY bench/replicas.py"
add troughs "$PY bench/troughs.py --seconds 30 --batch-items 400"
add features-backpressure "$PY bench/features_backpressure.py"
add prefix-affinity "$PY bench/prefix_affinity.py"
for scenario in examples/orchid/simulate/*.yaml; do
  name="$(basename "$scenario" .yaml)"
  add "simulate-$name" ".venv/bin/orchid-gateway simulate $scenario --check"
done

failed=0
for i in "${!NAMES[@]}"; do
  name="${NAMES[$i]}" command="${COMMANDS[$i]}"
  if [ "$#" -gt 0 ] && ! printf '%s\n' "$@" | grep -qx "$name"; then
    continue
  fi
  log="$LOGS/$name.txt"
  echo "== $name: $command" >&2
  start=$(date +%s)
  {
    echo "# $name at $commit, $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs"
    case "$command" in "$PY "*) echo "\$ python ${command#"$PY "}" ;; *) echo "\$ ${command#.venv/bin/}" ;; esac
    echo
  } > "$log"
  if $command >> "$log" 2>&1; then status=0; else status=$?; failed=$((failed + 1)); fi
  echo "   exit $status after $(( $(date +%s) - start )) s: $log" >&2
done
exit "$failed"
