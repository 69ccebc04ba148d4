"""The live policy: one current snapshot, atomic hot reload, keep-last-good.

This module owns *which* ``PolicySnapshot`` is current. ``reload`` compiles the
whole directory into a new snapshot and swaps it in with one reference
assignment; on any problem - a YAML or CEL error, a half-written or empty
file, a directory that vanished - the previous snapshot stays live, the
problems come back as ``file:line:col`` diagnostics, are logged, and count in
``orchid_policy_reloads_total{result="failed"}``. Nothing is ever half
applied (OPA bundles and Cerbos behave the same).

``ready`` is False until the first good load: the gateway must not admit
traffic without a policy. ``watch`` polls the directory's content hash (the
same hash as ``PolicySnapshot.version``) and reloads when it changes; it uses
asyncio only and runs file reads and compilation in a worker thread so the
event loop never blocks on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gateway.core.errors import Unavailable
from gateway.core.record import RequestRecord
from gateway.policy.diagnostics import Diagnostic, PolicyLoadError
from gateway.policy.engine import DEFAULT_ENGINE, Engine
from gateway.policy.loader import compile_policies, content_hash, directory_hash, read_policy_dir
from gateway.policy.metrics import POLICY_EVAL_SECONDS, POLICY_FAIL_OPEN, POLICY_RELOADS, POLICY_RULE_ERRORS
from gateway.policy.schema import PolicyContext
from gateway.policy.snapshot import PolicyResult, PolicySnapshot

LOG = logging.getLogger("gateway.policy")


@dataclass(frozen=True, slots=True)
class ReloadResult:
    """What one ``reload`` did."""

    ok: bool
    version: str  # the version live after the attempt ("" while none is)
    previous_version: str  # the version live before it
    attempted_version: str  # content hash of what was read ("" when unreadable)
    diagnostics: tuple[Diagnostic, ...] = ()

    @property
    def changed(self) -> bool:
        return self.version != self.previous_version


class PolicyStore:
    """Holds the current snapshot of one policy directory."""

    def __init__(
        self,
        directory: str | Path,
        *,
        engine: str | Engine = DEFAULT_ENGINE,
        logger: logging.Logger | None = None,
    ) -> None:
        self._directory = Path(directory)
        self._engine = engine
        self._log = logger or LOG
        self._snapshot: PolicySnapshot | None = None
        # Called with "policy" whenever a reload swaps a new snapshot in (the gateway's generation).
        self.on_change: Callable[[str], object] | None = None
        self._lock = threading.Lock()
        self._failures = 0
        self._last_diagnostics: tuple[Diagnostic, ...] = ()
        self._attempted_hash: str | None = None

    @property
    def directory(self) -> Path:
        return self._directory

    @property
    def snapshot(self) -> PolicySnapshot | None:
        """The live snapshot (``None`` before the first good load)."""
        return self._snapshot

    @property
    def ready(self) -> bool:
        return self._snapshot is not None

    @property
    def version(self) -> str:
        return self._snapshot.version if self._snapshot is not None else ""

    @property
    def failures(self) -> int:
        """Reloads rejected since this store was created."""
        return self._failures

    @property
    def last_diagnostics(self) -> tuple[Diagnostic, ...]:
        """Problems of the most recent rejected reload (cleared by a good one)."""
        return self._last_diagnostics

    def current(self) -> PolicySnapshot:
        """The live snapshot; ``Unavailable`` before the first good load."""
        snapshot = self._snapshot
        if snapshot is None:
            raise Unavailable("policy is not loaded yet")
        return snapshot

    def evaluate(
        self, record: RequestRecord, context: PolicyContext, snapshot: PolicySnapshot | None = None
    ) -> PolicyResult:
        """Evaluate with ``snapshot`` (default: the live one) and record latency, errors and
        fail-open in metrics. A request's candidates are all judged by the one snapshot it took
        (``current``): a reload between them must not judge them by two policy versions."""
        result = (snapshot or self.current()).evaluate(record, context, timer=time.perf_counter_ns)
        POLICY_EVAL_SECONDS.observe(result.eval_us / 1e6)
        for error in result.errors:
            POLICY_RULE_ERRORS.labels(error.rule).inc()
        for event in result.fail_open:
            POLICY_FAIL_OPEN.labels(event.rule).inc()
        return result

    def reload(self) -> ReloadResult:
        """Compile the directory and swap the new snapshot in; keep the last good one on any error."""
        with self._lock:
            previous = self._snapshot
            previous_version = previous.version if previous is not None else ""
            attempted = ""
            try:
                files = read_policy_dir(self._directory)
                attempted = content_hash(files)
                self._attempted_hash = attempted
                snapshot = compile_policies(files, engine=self._engine, base=self._directory)
            except PolicyLoadError as exc:
                if not attempted:
                    self._attempted_hash = None
                return self._rejected(previous_version, attempted, exc.diagnostics)
            except Exception as exc:  # a bug must not take the live policy down with it
                self._log.exception("policy reload crashed; keeping %s", previous_version or "no policy")
                problem = Diagnostic(
                    str(self._directory), 1, 1, f"internal error while loading policy: {exc!r}"
                )
                return self._rejected(previous_version, attempted, (problem,))
            self._snapshot = snapshot
            self._last_diagnostics = ()
            if self.on_change is not None and snapshot.version != previous_version:
                self.on_change("policy")
            POLICY_RELOADS.labels("ok").inc()
            if snapshot.version != previous_version:
                self._log.info(
                    "policy %s loaded from %s: %d rules, engine %s (was %s)",
                    snapshot.display_version,
                    self._directory,
                    len(snapshot.rules),
                    snapshot.engine_name,
                    previous_version or "none",
                )
            return ReloadResult(True, snapshot.version, previous_version, attempted)

    def _rejected(
        self, previous_version: str, attempted: str, diagnostics: tuple[Diagnostic, ...]
    ) -> ReloadResult:
        self._failures += 1
        self._last_diagnostics = diagnostics
        POLICY_RELOADS.labels("failed").inc()
        self._log.error(
            "policy reload from %s rejected (%d problem%s); keeping %s",
            self._directory,
            len(diagnostics),
            "" if len(diagnostics) == 1 else "s",
            previous_version or "no policy (not ready)",
        )
        for diagnostic in diagnostics:
            self._log.error("%s", diagnostic.headline())
        return ReloadResult(False, previous_version, previous_version, attempted, diagnostics)

    async def watch(self, interval_s: float = 1.0, *, stop: asyncio.Event | None = None) -> None:
        """Poll the directory's content hash every ``interval_s`` and reload on change, until ``stop``."""
        stop = stop or asyncio.Event()
        seen = self._attempted_hash
        while not stop.is_set():
            current = await asyncio.to_thread(directory_hash, self._directory)
            if current != seen:
                await asyncio.to_thread(self.reload)
                # Remember what this attempt read, good or bad: a bad edit is reported once,
                # not every interval, and the next edit triggers the next attempt.
                seen = self._attempted_hash if current is not None else None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval_s)
