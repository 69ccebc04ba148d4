"""``orchid-gateway policy lint PATH``: parse and type-check a policy set.

Prints every problem as ``file:line:col: message`` with the offending line and
a caret, or a one-line summary of the compiled set. Exit codes (``orchid_tools.cli``):
0 the set compiles, 1 it does not, 2 usage error (PATH missing).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gateway.policy.diagnostics import PolicyLoadError, render_all
from gateway.policy.engine import DEFAULT_ENGINE, ENGINE_NAMES
from gateway.policy.loader import compile_policies, load_policies
from gateway.policy.model import RuleMode
from gateway.policy.snapshot import PolicySnapshot


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="policy directory (or a single policy file)")
    parser.add_argument(
        "--engine", choices=ENGINE_NAMES, default=DEFAULT_ENGINE, help="CEL engine (default %(default)s)"
    )


def load_path(path: Path, engine: str) -> PolicySnapshot:
    """A directory, or one file compiled alone; raises ``PolicyLoadError``."""
    if path.is_dir():
        return load_policies(path, engine=engine)
    return compile_policies({path.name: path.read_bytes()}, engine=engine, base=path.parent)


def run(args: argparse.Namespace) -> int:
    path = Path(args.path)
    if not path.exists():
        print(f"orchid-gateway policy lint: {path}: no such file or directory", file=sys.stderr)
        return 2
    try:
        snapshot = load_path(path, args.engine)
    except PolicyLoadError as exc:
        print(render_all(exc.diagnostics))
        count = len(exc.diagnostics)
        print(f"{count} problem{'s' if count != 1 else ''} in {path} (engine {args.engine})")
        return 1
    shadow = sum(1 for rule in snapshot.rules if rule.mode is RuleMode.SHADOW)
    print(
        f"ok: {len(snapshot.rules)} rules ({shadow} shadow), {len(snapshot.variables)} variables "
        f"in {len(snapshot.files)} files; version {snapshot.display_version}; engine {snapshot.engine_name}"
    )
    return 0
