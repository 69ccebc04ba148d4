"""The ``orchid-gateway`` command line.

Each subcommand lives beside the code it drives and exposes two functions:
``add_arguments(parser)`` and ``run(args) -> int`` (the exit code). This module
only assembles the parser and dispatches; it holds no behaviour of its own.

Exit codes shared by all subcommands: 0 success, 1 the checked thing is bad
(invalid policy, failing test, severe finding), 2 usage error (bad flags,
missing file), 3 the thing could not run (startup failure).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# (command path, module providing add_arguments/run, help)
_COMMANDS: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (("serve",), "gateway.server", "run the gateway (and, by default, a supervised local Triton)"),
    (("demo",), "orchid_tools.demo", "start the local stack, drive the demo workload, print a summary"),
    (("policy", "lint"), "gateway.policy.cli_lint", "parse and type-check policy files"),
    (("policy", "test"), "gateway.policy.cli_test", "run the policy test suites"),
    (("policy", "explain"), "gateway.policy.cli_explain", "evaluate every rule for one request record"),
    (("capacity",), "orchid_tools.capacity", "print the capacity worksheet for a workload file"),
    (("simulate",), "orchid_tools.simulate", "run a scenario through the runtime in virtual time"),
    (("evidence",), "orchid_tools.evidence", "publish or list quality evidence through the admin RPC"),
    (("rollout",), "orchid_tools.rollout", "start, watch, promote, roll back or abort a version change"),
    (("devices",), "orchid_tools.devices", "a topology's units; mark devices lost or back"),
    (("audit", "isolation"), "orchid_tools.audit", "who can reach what, who can share an instance"),
    (("jobs",), "orchid_tools.jobs", "submit, get, wait for, cancel and list asynchronous operations"),
    (("batch",), "orchid_tools.batch", "submit a JSONL batch, follow it, fetch its manifest and output set"),
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="orchid-gateway", description=__doc__.splitlines()[0] if __doc__ else None)
    groups: dict[tuple[str, ...], argparse._SubParsersAction[argparse.ArgumentParser]] = {
        (): parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    }
    for path, module_name, help_text in _COMMANDS:
        for depth in range(1, len(path)):
            prefix = path[:depth]
            if prefix not in groups:
                group_parser = groups[prefix[:-1]].add_parser(prefix[-1], help=f"{prefix[-1]} commands")
                groups[prefix] = group_parser.add_subparsers(
                    dest="_".join(prefix) + "_command", required=True, parser_class=_Parser
                )
        sub = groups[path[:-1]].add_parser(path[-1], help=help_text, description=help_text)
        sub.set_defaults(_module=module_name)
        importlib.import_module(module_name).add_arguments(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    module = importlib.import_module(args._module)
    return int(module.run(args))


if __name__ == "__main__":
    sys.exit(main())
