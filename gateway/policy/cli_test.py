"""``orchid-gateway policy test PATH``: run the policy's test suites.

Suites live next to the policies (``PATH/tests/*.yaml``, format in
``gateway.policy.suites``). Prints PASS/FAIL per case with every mismatch, then
the rules no case made fire. Exit codes: 0 all cases pass, 1 a case fails or
the policy or a suite is invalid (or, with ``--require-coverage``, a rule is
never exercised), 2 usage error (PATH or the tests directory missing).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gateway.policy.diagnostics import PolicyLoadError, render_all
from gateway.policy.engine import DEFAULT_ENGINE, ENGINE_NAMES
from gateway.policy.loader import TESTS_DIR, load_policies
from gateway.policy.suites import load_suites, run_cases


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="policy directory; suites are read from PATH/tests")
    parser.add_argument(
        "--engine", choices=ENGINE_NAMES, default=DEFAULT_ENGINE, help="CEL engine (default %(default)s)"
    )
    parser.add_argument("--tests", help="directory of test suites (default PATH/tests)")
    parser.add_argument(
        "--require-coverage", action="store_true", help="fail when a rule is not exercised by any case"
    )


def run(args: argparse.Namespace) -> int:
    path = Path(args.path)
    tests = Path(args.tests) if args.tests else path / TESTS_DIR
    if not path.is_dir():
        print(f"orchid-gateway policy test: {path}: not a policy directory", file=sys.stderr)
        return 2
    if not tests.is_dir():
        print(f"orchid-gateway policy test: {tests}: no test suites directory", file=sys.stderr)
        return 2
    try:
        snapshot = load_policies(path, engine=args.engine)
        cases = load_suites(tests)
    except PolicyLoadError as exc:
        print(render_all(exc.diagnostics))
        return 1
    if not cases:
        print(f"no test cases in {tests}")
        return 1
    report = run_cases(snapshot, cases)
    for outcome in report.results:
        case = outcome.case
        print(f"{'PASS' if outcome.passed else 'FAIL'} {case.suite}: {case.name}")
        if not outcome.passed:
            for mismatch in outcome.mismatches:
                print(f"    {mismatch}")
            print(f"    at {case.source}")
    failed = len(report.failed)
    passed = len(report.results) - failed
    print(
        f"{passed} passed, {failed} failed; policy {snapshot.display_version}, engine {snapshot.engine_name}"
    )
    if report.unexercised:
        print(f"rules not exercised by any test ({len(report.unexercised)}): {', '.join(report.unexercised)}")
    else:
        print(f"every rule is exercised by at least one test ({len(snapshot.rules)} rules)")
    if failed:
        return 1
    if args.require_coverage and report.unexercised:
        return 1
    return 0
