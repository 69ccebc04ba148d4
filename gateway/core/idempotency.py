"""Online idempotency: what a request carrying ``orchid.operation_id`` gets, as a state machine.

The seed: "retrying inference can duplicate downstream effects; use an operation identity
and idempotent effect boundary". This module owns every rule about an online operation id;
it holds no answers' meaning (opaque bytes), reads no clock (``now`` is handed in) and
awaits nothing. ``gateway.idempotent`` runs the first attempt and parks the retries.

Rules:

1. **Scope.** An operation id is its tenant's: (tenant, id) is the key, so two tenants
   using the same id never meet, and one cannot learn whether another used an id.
2. **The first attempt runs** (``begin`` answers ``START``); its entry is *in flight*,
   holding a fingerprint of the request (a hash of everything the caller sent but the id).
3. **A retry while it is in flight joins it** (``JOIN``): it waits for the same answer and
   does not run again (no second execution, no second charge).
4. **After completion, for ``window_s``, a retry gets the same answer** (``REPLAY``), or,
   when the answer was too large to hold (over ``max_answer_bytes``) or its bytes were
   given up for newer answers, ``GONE``: ALREADY_EXISTS, saying the operation completed
   and its answer is no longer held. Either way it does not run again in the window.
5. **A failed attempt leaves nothing** (``fail``): an error answer had no effect to
   protect, so the next retry runs again. The retries that had joined it got its error.
6. **The same id with a different request is refused** (``CONFLICT``, ALREADY_EXISTS,
   while the id is held): a caller never gets another request's answer.
7. **Bounded.** At most ``max_entries`` ids and ``max_bytes`` (held answers plus
   ``ENTRY_BYTES`` per id). Room is made by expiring entries past their window, then by
   dropping the oldest held answers' bytes (their entries stay: rule 4's ``GONE``). An id
   is never forgotten inside its window for room: when every entry is in flight or
   inside its window, a new id is refused (``FULL``: RESOURCE_EXHAUSTED, with the time
   until the oldest window ends); the caller may retry then, or send without an id.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass

# Long enough for a client's retries with backoff after a lost answer (gRPC's default retry
# policies back off for seconds to a minute), short enough that held answers turn over.
WINDOW_S = 300.0
# Ten thousand operations completing inside one window is ~33/s with ids, per gateway.
MAX_ENTRIES = 10_000
# Held answers, all tenants together: small beside a gateway's heap, and the bound holds.
MAX_BYTES = 64 * 1024 * 1024
# An answer larger than this is not held (rule 4's GONE): a few cannot crowd out the rest.
MAX_ANSWER_BYTES = 1024 * 1024
# What an entry costs without its answer: the key (a tenant, an id of up to 128 characters),
# a 16-byte fingerprint and the bookkeeping around them.
ENTRY_BYTES = 512


class Step(enum.StrEnum):
    START = "start"
    JOIN = "join"
    REPLAY = "replay"
    GONE = "gone"
    CONFLICT = "conflict"
    FULL = "full"


@dataclass(frozen=True, slots=True)
class Begin:
    """What ``begin`` decided for one request."""

    step: Step
    answer: bytes | None = None  # REPLAY: the first attempt's answer
    message: str = ""  # GONE, CONFLICT, FULL: for the caller
    retry_after_ms: int | None = None  # FULL: when the oldest window ends


@dataclass(slots=True)
class _Entry:
    fingerprint: bytes
    started_at: float
    done_at: float | None = None  # None: in flight
    answer: bytes | None = None


class OperationTable:
    """Every (tenant, operation id) held: in flight, or completed inside its window."""

    def __init__(
        self,
        *,
        window_s: float = WINDOW_S,
        max_entries: int = MAX_ENTRIES,
        max_bytes: int = MAX_BYTES,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
    ) -> None:
        self.window_s = window_s
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.max_answer_bytes = max_answer_bytes
        # Insertion order is completion order for completed entries (moved to the end on
        # ``finish``), so the oldest window is first.
        self._entries: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self._answer_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def held_bytes(self) -> int:
        """Held answers plus ``ENTRY_BYTES`` per entry: what rule 7 bounds."""
        return self._answer_bytes + ENTRY_BYTES * len(self._entries)

    def begin(self, tenant: str, operation_id: str, fingerprint: bytes, now: float) -> Begin:
        self._expire(now)
        key = (tenant, operation_id)
        entry = self._entries.get(key)
        if entry is not None:
            if entry.fingerprint != fingerprint:
                return Begin(
                    Step.CONFLICT,
                    # The id is not echoed: parameters may carry user data (docs/security.md).
                    message="this orchid.operation_id was used for a different request (held for "
                    f"{self.window_s:.0f} s after it completes); a new request needs a new id",
                )
            if entry.done_at is None:
                return Begin(Step.JOIN)
            if entry.answer is None:
                return Begin(
                    Step.GONE,
                    message="the operation with this orchid.operation_id already completed; its "
                    "answer is no longer held (too large, or given up for newer answers), and it is "
                    "not run again",
                )
            return Begin(Step.REPLAY, answer=entry.answer)
        if len(self._entries) >= self.max_entries or self.held_bytes + ENTRY_BYTES > self.max_bytes:
            self._drop_answers(ENTRY_BYTES)
        if len(self._entries) >= self.max_entries or self.held_bytes + ENTRY_BYTES > self.max_bytes:
            return Begin(
                Step.FULL,
                message=f"too many operation ids held ({len(self._entries)}); retry later, or send "
                "without orchid.operation_id",
                retry_after_ms=self._oldest_window_ms(now),
            )
        self._entries[key] = _Entry(fingerprint, now)
        return Begin(Step.START)

    def finish(self, tenant: str, operation_id: str, answer: bytes, now: float) -> None:
        """The first attempt answered: hold ``answer`` (when it fits) for ``window_s``."""
        key = (tenant, operation_id)
        entry = self._entries.get(key)
        if entry is None or entry.done_at is not None:
            return
        entry.done_at = now
        self._entries.move_to_end(key)
        if len(answer) > self.max_answer_bytes:
            return
        self._drop_answers(len(answer))
        if self.held_bytes + len(answer) <= self.max_bytes:
            entry.answer = answer
            self._answer_bytes += len(answer)

    def fail(self, tenant: str, operation_id: str) -> None:
        """The first attempt failed: forget the id (rule 5)."""
        entry = self._entries.get((tenant, operation_id))
        if entry is not None and entry.done_at is None:
            del self._entries[(tenant, operation_id)]

    def _expire(self, now: float) -> None:
        """Forget completed entries past their window. Completed entries are in completion
        order (``finish`` moves each to the end), in-flight ones are skipped: the walk stops
        at the first completed entry still inside its window."""
        expired: list[tuple[tuple[str, str], _Entry]] = []
        for key, entry in self._entries.items():
            if entry.done_at is None:
                continue
            if now - entry.done_at < self.window_s:
                break
            expired.append((key, entry))
        for key, entry in expired:
            self._forget(key, entry)

    def _forget(self, key: tuple[str, str], entry: _Entry) -> None:
        if entry.answer is not None:
            self._answer_bytes -= len(entry.answer)
        del self._entries[key]

    def _drop_answers(self, room: int) -> None:
        """Give up the oldest held answers' bytes until ``room`` more fits (rule 7)."""
        for entry in self._entries.values():
            if self.held_bytes + room <= self.max_bytes:
                return
            if entry.answer is not None:
                self._answer_bytes -= len(entry.answer)
                entry.answer = None

    def _oldest_window_ms(self, now: float) -> int:
        ends = [e.done_at + self.window_s for e in self._entries.values() if e.done_at is not None]
        if not ends:
            return 1000  # all in flight: they end by their deadlines
        return max(1, int((min(ends) - now) * 1000.0))
