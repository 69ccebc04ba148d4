"""Shared state of a fleet of gateway replicas: where quota ledgers and membership live.

Owns the seam between the request path and the state several replicas must agree on. The
decisions stay in ``gateway.core`` (``QuotaLedger`` is the one definition of quota
semantics); this package only decides *where* that state is kept: ``base`` holds the
``QuotaStore`` protocol the pipeline reserves through and the in-memory store (one
process, the default); ``redis`` keeps the same ledger in Redis for every replica, with
leases, membership heartbeats and the fail modes (``state.fail_mode``); ``lua`` holds the
server-side scripts that apply the core's rules atomically.
"""

from gateway.state.base import MemoryQuotaStore, QuotaStore

__all__ = ["MemoryQuotaStore", "QuotaStore"]
