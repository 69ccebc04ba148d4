"""Asynchronous and batch inference at the edge: the durable job store (``store``), the
JSONL batch codec (``batch``), the runner that feeds queued items through the gateway's own
request path in capacity troughs (``runner``) and the ``orchid.jobs.v1.Operations`` gRPC
service (``service``). The state machine, bounds and pacing they follow are pure functions
in ``gateway.core.jobs``."""
