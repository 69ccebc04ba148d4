"""The values one request's passage through the gateway produces, shared by every stage.

This module owns the request path's value types and nothing else: what the protocol
edge knows about a call (``CallContext``), a configured backend (``BackendHandle``), a
request admitted to a pool (``Admitted``), one that completed (``Settled``) with its
stage times, and the typed events the path emits (``GatewayListener``). They live apart
from the stages (``gateway.chain``) and the runtime container (``gateway.pipeline``) so
that rollouts, shadow traffic, streams, messages and telemetry can name them without
importing the request path: no module imports back into the one that drives it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import msgspec
from tritonclient.grpc import service_pb2

from gateway.backends.base import Backend
from gateway.config import RouteConfig, TopologyConfig
from gateway.core.estimate import CorrectionKey
from gateway.core.evidence import Evidence
from gateway.core.memory import DeviceMemory
from gateway.core.prefix import PrefixMatch
from gateway.core.quota import Reservation
from gateway.core.record import Decision, Outcome, RequestRecord
from gateway.core.settlement import StreamSummary
from gateway.core.upstream import FeatureSnapshot
from gateway.policy.snapshot import PolicyResult
from gateway.scheduler import DispatchQueue

# A random (version 4) UUID's bits: everything but the version and variant fields are random.
_UUID4_RANDOM = ~((0xF000 << 64) | (0xC000 << 48))
_UUID4_FIXED = (4 << 76) | (0x8000 << 48)


def new_request_id() -> str:
    """A request id: ``uuid.uuid4().hex`` (the same random bits and format), without building
    a ``UUID`` object on every request."""
    return f"{int.from_bytes(os.urandom(16)) & _UUID4_RANDOM | _UUID4_FIXED:032x}"


class StageTimes(msgspec.Struct, frozen=True, gc=False):
    """Monotonic timestamps of one request's stages (telemetry builds spans from them)."""

    received_at: float
    admitted_at: float
    dispatched_at: float
    finished_at: float


@dataclass(frozen=True, slots=True)
class BackendHandle:
    """A configured backend: its client and the facts from its config."""

    client: Backend
    labels: dict[str, str]
    devices: int
    max_inflight_per_device: int
    time_scale: float = 1.0  # its devices run time_scale x the profile's milliseconds
    shared_devices: bool = False  # all its models run on the same `devices` accelerators
    memory: DeviceMemory | None = None  # each device's memory; None: live state is not bounded
    topology: TopologyConfig | None = None  # parallel layouts and failure domains (dispatch rule 10)


class CallContext(msgspec.Struct, frozen=True, gc=False):
    """What the protocol edge knows about a call."""

    metadata: tuple[tuple[str, str | bytes], ...]
    time_remaining_s: float | None  # the caller's gRPC deadline, None if it set none
    received_at: float  # clock.now() when the call arrived (the event loop clock)
    peer_subjects: tuple[str, ...] = ()  # verified client-certificate common names (mTLS)


class Admitted(msgspec.Struct, frozen=True):
    """A request that passed admission, bound to a pool, ready to dispatch."""

    record: RequestRecord
    decision: Decision
    route: RouteConfig
    backend: Backend
    queue: DispatchQueue
    backend_request: service_pb2.ModelInferRequest
    deadline_at: float
    correction_key: CorrectionKey
    reservation: Reservation
    received_at: float
    admitted_at: float
    evidence: Evidence | None = None  # the quality evidence a degraded answer rests on
    # A canary's hedge: the candidate must answer by then, leaving the current version time.
    canary_deadline_at: float | None = None
    features: FeatureSnapshot | None = None  # the upstream features it reads (provenance)
    # Its prompt on its pool's prefix cache (gateway.core.prefix): recorded in the pool's index
    # when sent, and the backend's reported hit is learned when it is answered.
    prefix: PrefixMatch | None = None


class Settled(msgspec.Struct, frozen=True):
    record: RequestRecord
    decision: Decision
    outcome: Outcome
    stages: StageTimes | None = None
    evidence: Evidence | None = None  # the quality evidence a degraded answer rests on
    features: FeatureSnapshot | None = None  # the upstream features it read (provenance)


class GatewayListener:
    """Typed events out of the request path; telemetry subscribes. The base class ignores them.

    decided  every admission decision (admit, fallback, reject) with its policy result
    settled  every completed request with observed work and stage times
    failed   every call answered with an error status (``rule``: the deciding rule, or "")
    ladder   a pool's ladder step, after each update
    stream_settled  every stream request that ended, with its first-result and gap summary
    """

    def decided(self, record: RequestRecord, decision: Decision, policy: PolicyResult) -> None:
        return None

    def settled(self, settled: Settled) -> None:
        return None

    def failed(self, status: str, rule: str) -> None:
        return None

    def ladder(self, pool: str, step: int) -> None:
        return None

    def stream_settled(self, settled: Settled, stream: StreamSummary) -> None:
        """A stream request ended (final response, failure or cancel): its settlement and how
        its results met its objectives (``GapTracker.finish``; first result, gaps)."""
        return None
