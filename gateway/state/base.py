"""The quota store protocol and the in-memory store (one process: ``state.backend: memory``).

Owns the interface the request path reserves and settles quota through. Reserving is
awaitable because a shared store asks Redis; starting, settling and releasing are not
(they are called from synchronous settlement code: a shared store sends them in the
background, and its leases bound what a lost message costs). ``MemoryQuotaStore`` is the
core's ``QuotaLedger`` itself, answering at once.
"""

from __future__ import annotations

from typing import Protocol

from gateway.core.quota import (
    AccountTerms,
    Outstanding,
    QuotaAccounts,
    QuotaLedger,
    QuotaSettings,
    QuotaView,
    Reservation,
)
from gateway.core.record import RequestRecord

__all__ = ["MemoryQuotaStore", "QuotaStore"]


class QuotaStore(QuotaAccounts, Protocol):
    """Where the pipeline reserves, starts, settles and releases quota."""

    @property
    def settings(self) -> QuotaSettings: ...

    @property
    def degraded(self) -> bool:
        """True while the store cannot reach its shared state (always False in memory)."""
        ...

    def accounts(self) -> tuple[tuple[str, str], ...]: ...

    def terms(self, tenant: str, request_class: str) -> AccountTerms: ...

    def available(self, tenant: str, request_class: str, *, now: float) -> QuotaView: ...

    def outstanding(self) -> Outstanding:
        """This replica's open reservations."""
        ...

    async def reserve_admitted(self, record: RequestRecord, *, now: float) -> Reservation:
        """Reserve an admitted record's predicted demand, or raise the ledger's refusal."""
        ...


class MemoryQuotaStore(QuotaLedger):
    """The core ledger in this process: ``reserve_admitted`` is ``reserve_record``."""

    @property
    def degraded(self) -> bool:
        return False

    async def reserve_admitted(self, record: RequestRecord, *, now: float) -> Reservation:
        return self.reserve_record(record, now=now)
