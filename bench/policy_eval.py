"""Policy evaluation latency: the full default policy set, per request, on both CEL engines.

Prints p50/p90/p99/max microseconds per ``PolicySnapshot.evaluate`` call over a
rotation of representative requests (the seed's teaching request with one
foreign-cell backend, a late request rejected for negative slack, a long
request under load that trips the shadow rule and the output cap, a quota
rejection, a foreign privacy cell), then the same for ``explain`` (rule by
rule), then one admission-sized expression alone, to compare engines at the
expression level. ``evaluate, memo cleared`` is ``evaluate`` with the memo of the
stable plan emptied before each call (``snapshot.Plan.cached``): what the first
request of a tenant, route and class costs; later ones reuse it.

    python bench/policy_eval.py        # 3 runs x 5,000 evaluations on cel-expr, 3 x 300 on cel-python
    python bench/policy_eval.py --n 20000 --repeat 5 --check

``--check`` exits 1 when the default engine misses its target
(p50 <= 50 us, p99 <= 200 us per request). Numbers are wall-clock on a shared
machine: each engine is measured ``--repeat`` times and the run with the lowest
p50 is printed (timeit's "min" convention, against neighbours' noise); the load
average is printed with it. Quote ratios.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.core.record import RequestRecord
from gateway.policy import PolicyContext, PolicySnapshot, load_policies
from gateway.policy.engine import CompiledExpression, Engine, get_engine
from gateway.policy.schema import FIELDS, flat_inputs
from gateway.policy.suites import build_inputs

TARGET_P50_US = 50.0
TARGET_P99_US = 200.0

REQUESTS: dict[str, dict[str, Any]] = {
    "teaching request": {
        "backends": [
            {"name": "triton-eu-1", "model": "full-v18", "labels": {"cell": "eu-restricted"}},
            {"name": "triton-us-1", "model": "full-v18", "labels": {"cell": "us-general"}},
        ]
    },
    "late, slack < 0": {"budget": {"elapsed_ms": 150.0}},
    "long input, ladder 2": {
        "shape": {"input_tokens": 4096, "max_output_tokens": 8192},
        "demand": {"prefill_ms": 200.0, "decode_ms": 267.6},
        "budget": {"deadline_ms": 2000.0},
        "load": {"ladder_step": 2, "drain_ms": 300.0},
    },
    "quota exhausted": {"tenant": {"available_accelerator_ms": 20.0}},
    "foreign privacy cell": {"request": {"privacy_cell": "us-general"}},
}

ONE_EXPRESSION = (
    "request.privacy_cell in tenant.allowed_cells && budget.slack_ms >= 0.0 "
    "&& demand.accelerator_ms <= tenant.available_accelerator_ms"
)


def percentiles(samples_ns: list[int]) -> dict[str, float]:
    ordered = sorted(samples_ns)
    n = len(ordered)

    def at(q: float) -> float:
        return ordered[min(n - 1, int(q * n))] / 1000.0

    return {
        "p50": at(0.50),
        "p90": at(0.90),
        "p99": at(0.99),
        "max": ordered[-1] / 1000.0,
        "mean": statistics.fmean(ordered) / 1000.0,
    }


def measure(call: Callable[[], object], n: int, warmup: int) -> dict[str, float]:
    for _ in range(warmup):
        call()
    samples: list[int] = []
    clock = time.perf_counter_ns
    for _ in range(n):
        started = clock()
        call()
        samples.append(clock() - started)
    return percentiles(samples)


def rotation(
    snapshot: PolicySnapshot, inputs: list[tuple[RequestRecord, PolicyContext]], explain: bool
) -> Callable[[], object]:
    state = {"i": 0}
    run = snapshot.explain if explain else snapshot.evaluate

    def call() -> object:
        record, context = inputs[state["i"] % len(inputs)]
        state["i"] += 1
        return run(record, context)

    return call


def row(label: str, n: int, stats: dict[str, float]) -> str:
    return (
        f"{label:<34} {n:>7,} {stats['p50']:>9.1f} {stats['p90']:>9.1f} "
        f"{stats['p99']:>9.1f} {stats['max']:>10.1f} {stats['mean']:>9.1f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--n", type=int, default=5000, help="evaluations per run on cel-expr (default %(default)s)"
    )
    parser.add_argument("--python-n", type=int, default=300, help="evaluations per run on cel-python")
    parser.add_argument(
        "--repeat", type=int, default=3, help="runs per engine; the run with the lowest p50 is shown"
    )
    parser.add_argument("--policies", default="policies")
    parser.add_argument("--check", action="store_true", help="exit 1 when cel-expr misses p50/p99 targets")
    args = parser.parse_args(argv)

    inputs = [build_inputs(given) for given in REQUESTS.values()]
    print(f"# policy evaluation benchmark: {args.policies}, {len(REQUESTS)} requests in rotation")
    print(
        f"# python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs, gc enabled, "
        f"best of {args.repeat} runs by p50, load average {os.getloadavg()[0]:.2f}"
    )
    columns = ("p50 us", "p90 us", "p99 us")
    header = (
        f"{'engine / path':<34} {'n':>7} "
        + " ".join(f"{c:>9}" for c in columns)
        + f" {'max us':>10} {'mean us':>9}"
    )
    print(header)
    print("-" * len(header))

    def best(call: Callable[[], object], n: int, warmup: int) -> dict[str, float]:
        runs = [measure(call, n, warmup) for _ in range(max(1, args.repeat))]
        return min(runs, key=lambda stats: stats["p50"])

    results: dict[str, dict[str, float]] = {}
    for engine, n in (("cel-expr", args.n), ("cel-python", args.python_n)):
        snapshot = load_policies(args.policies, engine=engine)
        if engine == "cel-expr":
            rules, variables = len(snapshot.rules), len(snapshot.variables)
            print(f"# {snapshot.display_version}: {rules} rules, {variables} variables")
        gc.collect()
        stats = best(rotation(snapshot, inputs, explain=False), n, max(10, n // 20))
        results[engine] = stats
        print(row(f"{engine} evaluate (per request)", n, stats))
        if snapshot.planned:
            memo_missed = rotation(snapshot, inputs, explain=False)

            def first(
                call: Callable[[], object] = memo_missed, snapshot: PolicySnapshot = snapshot
            ) -> object:
                snapshot.clear_memo()  # every request as if its tenant, route and class were new
                return call()

            print(row(f"{engine} evaluate, memo cleared", n, best(first, n, max(10, n // 20))))
        explain_n = max(50, n // 10)
        print(
            row(
                f"{engine} explain (rule by rule)",
                explain_n,
                best(rotation(snapshot, inputs, True), explain_n, 5),
            )
        )

    snapshot = load_policies(args.policies, engine="cel-expr")
    for name, (record, context) in zip(REQUESTS, inputs, strict=True):
        outcome = snapshot.evaluate(record, context)
        label = f"  {name} ({outcome.outcome})"

        def single(record: RequestRecord = record, context: PolicyContext = context) -> object:
            return snapshot.evaluate(record, context)

        print(row(label[:34], args.n // 5, best(single, args.n // 5, 20)))

    record, context = inputs[0]
    declarations = {f.path: f.cel_type for f in FIELDS}
    flat = flat_inputs(record, context)
    needed = {path: flat[path] for path in declarations if path in ONE_EXPRESSION}
    for engine, n in (("cel-expr", args.n), ("cel-python", args.python_n * 5)):
        cel = get_engine(engine)
        compiled = cel.compile(ONE_EXPRESSION, declarations)

        def one(cel: Engine = cel, compiled: CompiledExpression = compiled) -> object:
            return compiled.evaluate(cel.bind(needed))

        print(row(f"{engine} one expression (bind+eval)", n, best(one, n, 20)))

    default = results["cel-expr"]
    verdict = default["p50"] <= TARGET_P50_US and default["p99"] <= TARGET_P99_US
    ratio = results["cel-python"]["p50"] / default["p50"]
    print(
        f"# cel-expr per request: p50 {default['p50']:.1f} us (target <= {TARGET_P50_US:.0f}), "
        f"p99 {default['p99']:.1f} us (target <= {TARGET_P99_US:.0f}): {'met' if verdict else 'MISSED'}"
    )
    print(f"# cel-python is {ratio:.0f}x slower per request at p50")
    return 0 if verdict or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
