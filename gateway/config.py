"""Gateway configuration: files in, validated immutable settings out.

Owns the schema of ``gateway.yaml`` (listener, backends, local Triton, request
classes, limits), the tenants file (hashed API keys, what each tenant may
reach) and the route files under ``routes/`` (logical models, shape
extraction, demand profiles, fallbacks, quality evidence). Loading is the only
I/O here, through the one located-YAML reader (``gateway.yaml_source``); every
error becomes a ``ConfigError`` naming ``file:line:col`` of the offending key
(pydantic's validation errors and the cross-file checks included), the dotted
key path and what is wrong, so ``serve`` can exit with a message an operator
can act on.
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gateway.core.errors import ConfigError
from gateway.core.memory import SEED_DEVICE_MEMORY_GIB, SEED_RUNTIME_RESERVE_GIB, DeviceMemory, resident_bytes
from gateway.core.overload import DEFAULT_LADDER
from gateway.core.profile import DemandProfile
from gateway.core.quota import QuotaSettings
from gateway.core.risk import DEFAULT_RISK_CLASSES
from gateway.core.topology import Layout, Topology, TopologyError, Unit, available, parse_devices, plan_units
from gateway.settings import DemandProfileValue, LadderValue, OutputCheckValue, QuotaSettingsValue
from gateway.yaml_source import KeyPath, YamlDocument, YamlError, key_path, read_yaml

_M = TypeVar("_M", bound=BaseModel)


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# --------------------------------------------------------------------------- gateway.yaml


def _repository_key_env() -> str | None:
    key_env: str | None = Field(
        default=None,
        pattern=r"^[A-Z_][A-Z0-9_]*$",
        description="environment variable holding the key of Triton's restricted model-repository "
        "protocol (--grpc-restricted-protocol=model-repository:orchid-repository-key=KEY): rollouts "
        "send it on every load, unload and index call",
    )
    return key_env


DeviceList = str | int | tuple[int, ...]


class LayoutConfig(_Strict):
    """A model's parallel layout on a backend (``gateway.core.topology.Layout``)."""

    tensor_parallel: int = Field(default=1, ge=1, description="devices one shard group spans")
    pipeline_stages: tuple[float, ...] = Field(
        default=(1.0,), min_length=1, description="each pipeline stage's share of the work (sum 1)"
    )
    bubble_fraction: float = Field(default=0.0, ge=0, lt=1, description="idle share of a pipeline's cadence")
    data_parallel: int | None = Field(
        default=None, ge=1, description="how many units (default: all that fit)"
    )
    units: tuple[DeviceList, ...] | None = Field(default=None, description="each unit's devices, spelled out")
    measured_as: Literal["wall_ms", "unit_device_ms"] = Field(
        default="wall_ms",
        description="the route profile's ms: the wall time of an execution on its unit, or device-ms "
        "of the whole unit",
    )

    def layout(self) -> Layout:
        units = None if self.units is None else tuple(parse_devices(u) for u in self.units)
        return Layout(
            tensor_parallel=self.tensor_parallel,
            stage_shares=self.pipeline_stages,
            bubble_fraction=self.bubble_fraction,
            data_parallel=self.data_parallel,
            units=units,
            measured_as=self.measured_as,
        )


class TopologyConfig(_Strict):
    """A backend's device topology: failure domains, link groups, and its models' layouts.
    With a topology every model on the backend runs on its ``devices`` (one device set); a
    model with no layout is one device per unit."""

    domains: dict[str, dict[str, DeviceList]] = Field(
        default_factory=dict, description="kind (host, rack, ...) -> name -> its devices"
    )
    links: dict[str, DeviceList] = Field(
        default_factory=dict, description="link groups (e.g. NVLink islands): a unit never spans two"
    )
    models: dict[str, LayoutConfig] = Field(default_factory=dict, description="backend model -> its layout")
    lost: DeviceList = Field(default=(), description="devices lost at start")

    def topology(self, devices: int) -> Topology:
        return Topology(
            devices,
            domains={k: {n: parse_devices(d) for n, d in names.items()} for k, names in self.domains.items()},
            links={n: parse_devices(d) for n, d in self.links.items()},
        )

    def layout_of(self, model: str) -> Layout:
        config = self.models.get(model)
        return config.layout() if config is not None else Layout()

    def units_of(self, devices: int, model: str) -> tuple[Unit, ...]:
        return plan_units(self.topology(devices), self.layout_of(model), model)

    def lost_devices(self) -> tuple[int, ...]:
        return parse_devices(self.lost)

    def check(self, devices: int) -> None:
        """Every declared layout placed on the devices (raises ValueError saying why not)."""
        try:
            topology = self.topology(devices)
            lost = self.lost_devices()
            for d in lost:
                topology.check_device(d, "lost")
            for model in self.models:
                units = self.units_of(devices, model)
                if not available(units, lost):
                    raise TopologyError(f"{model}: every unit spans a lost device")
        except (TopologyError, ValueError) as exc:
            raise ValueError(str(exc)) from None


class BackendConfig(_Strict):
    """One Triton endpoint. ``devices`` is how many accelerators (or emulated instances) it has."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    address: str = Field(description="host:port of Triton's gRPC endpoint")
    labels: dict[str, str]
    devices: int = Field(ge=1)
    max_inflight_per_device: int = Field(default=2, ge=1)
    shared_devices: bool = Field(
        default=False,
        description="all its models run on the same `devices` accelerators (e.g. the fallback placed "
        "beside the primary on each device): dispatch predicts device time across all of them",
    )
    time_scale: float = Field(
        default=1.0, gt=0, description="its devices run time_scale x profile ms (capacity emulators)"
    )
    device_memory_gib: float = Field(
        default=SEED_DEVICE_MEMORY_GIB, gt=0, description="memory of each device (the live-memory bound)"
    )
    runtime_reserve_gib: float = Field(
        default=SEED_RUNTIME_RESERVE_GIB,
        ge=0,
        description="per device: runtime, workspace and allocator reserve, not for models or live state",
    )
    repository_key_env: str | None = _repository_key_env()
    topology: TopologyConfig | None = Field(
        default=None, description="parallel layouts and failure domains (gateway.core.topology)"
    )

    @property
    def memory(self) -> DeviceMemory:
        return DeviceMemory.from_gib(self.device_memory_gib, self.runtime_reserve_gib)

    @model_validator(mode="after")
    def _topology_fits(self) -> BackendConfig:
        if self.topology is not None:
            self.topology.check(self.devices)
        return self

    @field_validator("labels")
    @classmethod
    def _required_labels(cls, labels: dict[str, str]) -> dict[str, str]:
        missing = [k for k in ("cell", "device_group") if k not in labels]
        if missing:
            raise ValueError(f"labels must include {', '.join(missing)}")
        return labels


class LocalTritonConfig(_Strict):
    """The embedded default: a supervised local Triton from the nvidia-pytriton wheel."""

    model_repository: Path
    grpc_port: int = Field(default=0, ge=0, le=65535, description="0 picks a free port")
    time_factor: float = Field(default=1.0, ge=0)
    startup_timeout_s: float = Field(default=90.0, gt=0)
    labels: dict[str, str] = Field(default_factory=lambda: {"cell": "eu-restricted", "device_group": "local"})
    devices: int = Field(default=4, ge=1)
    max_inflight_per_device: int = Field(default=2, ge=1)
    shared_devices: bool = Field(
        default=False,
        description="all its models run on the same `devices` accelerators (e.g. the fallback placed "
        "beside the primary on each device): dispatch predicts device time across all of them",
    )
    device_memory_gib: float = Field(
        default=SEED_DEVICE_MEMORY_GIB, gt=0, description="memory of each device (the live-memory bound)"
    )
    runtime_reserve_gib: float = Field(
        default=SEED_RUNTIME_RESERVE_GIB,
        ge=0,
        description="per device: runtime, workspace and allocator reserve, not for models or live state",
    )
    model_control: Literal["none", "explicit"] = Field(
        default="none",
        description="explicit: Triton loads only load_models at start and the gateway's rollouts load "
        "and unload versions through its repository API (with --strict-readiness=false)",
    )
    load_models: tuple[str, ...] = Field(
        default=(), description="model_control explicit: the models loaded at start (empty: all)"
    )
    repository_key_env: str | None = _repository_key_env()
    topology: TopologyConfig | None = Field(
        default=None, description="parallel layouts and failure domains (gateway.core.topology)"
    )

    @model_validator(mode="after")
    def _load_models_need_explicit(self) -> LocalTritonConfig:
        if self.load_models and self.model_control != "explicit":
            raise ValueError("load_models is only read with model_control: explicit")
        if self.topology is not None:
            self.topology.check(self.devices)
        return self

    def triton_args(self, repository_key: str | None = None) -> tuple[str, ...]:
        """The server flags that model control (and the repository API's key) take."""
        restricted = (
            (f"--grpc-restricted-protocol=model-repository:orchid-repository-key={repository_key}",)
            if repository_key
            else ()
        )
        if self.model_control == "none":
            return restricted
        loads = self.load_models or ("*",)
        return (
            "--model-control-mode=explicit",
            "--strict-readiness=false",
            *(f"--load-model={m}" for m in loads),
            *restricted,
        )


class RequestClassConfig(_Strict):
    """Deadline reserves of a request class (the seed's R_up and R_fail; R_exec is predicted)."""

    default_deadline_ms: float = Field(gt=0)
    reserve_upstream_ms: float = Field(default=0.0, ge=0)
    reserve_fail_ms: float = Field(default=0.0, ge=0)
    max_dwell_ms: float = Field(default=20.0, ge=0)
    weight: float = Field(default=1.0, gt=0, description="the class's share of a pool under contention")
    max_deadline_ms: float = Field(default=600_000.0, gt=0, description="longer deadlines are refused")
    # Stream objectives (ModelStreamInfer; gateway.core.streaming). A stream's completion
    # deadline is the call's deadline, or default_deadline_ms, as for unary work.
    first_result_ms: float | None = Field(
        default=None,
        gt=0,
        description="a stream's first result within this many ms of its arrival; admission judges "
        "a new stream by it (none: the completion deadline; never later than it)",
    )
    gap_ms: float | None = Field(
        default=None, gt=0, description="a stream's objective for the gap between two results (none: none)"
    )

    @model_validator(mode="after")
    def _stream_objectives(self) -> RequestClassConfig:
        for name in ("first_result_ms", "gap_ms"):
            value = getattr(self, name)
            if value is not None and value > self.max_deadline_ms:
                raise ValueError(f"{name} ({value:g}) exceeds max_deadline_ms ({self.max_deadline_ms:g})")
        return self


class LimitsConfig(_Strict):
    max_message_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    drain_timeout_s: float = Field(default=10.0, ge=0)
    max_queued_per_backend: int = Field(default=256, ge=1)
    reserved_control_slots: int = Field(
        default=1, ge=0, description="slots per pool only control work may use"
    )
    short_lane_devices: int = Field(
        default=2,
        ge=0,
        description="devices per pool long-bucket work never occupies (0: none): short work "
        "always finds a device within one short request's time, not behind long ones",
    )
    short_lane_soft_devices: int = Field(
        default=0,
        ge=0,
        description="further devices per pool long-bucket work takes only when waiting for one "
        "of its own would make it miss its latest start (0: none)",
    )
    co_batch_max: int = Field(
        default=2,
        ge=1,
        description="most short requests of one pool bound together into one backend batch "
        "when every device is busy and the padded batch still meets each member's deadline "
        "(1: never co-batch; also capped by the model's max_batch_size)",
    )
    max_consecutive_grants: int = Field(
        default=8,
        ge=1,
        description="most dispatch grants in a row one tenant of a class takes from a pool while "
        "another of the class waits (dispatch rule 3)",
    )
    stream_share: bool = Field(
        default=True,
        description="bound each tenant's concurrently decoding streams and their live tokens, per "
        "pool, by its weighted share (a tenant alone may use the whole pool; dispatch rule 9)",
    )
    max_decoding_streams_per_tenant: int | None = Field(
        default=None,
        ge=1,
        description="most concurrently decoding streams per tenant and pool, whatever its share "
        "(unset: the share alone)",
    )


class TlsConfig(_Strict):
    """TLS on the listener; with ``client_ca_file``, mutual TLS (client certificates)."""

    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = Field(
        default=None, description="CA of client certificates: set, it makes the listener mutual TLS"
    )


class TelemetryConfig(_Strict):
    metrics_listen: str | None = Field(
        default=None,
        description="host:port of the HTTP telemetry listener (/metrics; /status with status_page); "
        "no host: 127.0.0.1",
    )
    status_page: bool = Field(
        default=True, description="serve /status and /status.json (admin credential) on metrics_listen"
    )
    decision_log: str | None = Field(default=None, description="file for JSON-lines decisions; None: logger")
    trace_sample_ratio: float = Field(default=0.0, ge=0, le=1)
    tenant_labels: bool = Field(default=False, description="label metrics with tenant ids")


class JobsConfig(_Strict):
    """Asynchronous and batch jobs (``orchid.jobs.v1.Operations``, ``gateway.jobs``): the store,
    the bounds (``gateway.core.jobs.JobLimits``) and how the runner uses troughs."""

    store: str = Field(default="sqlite", pattern="^(sqlite|postgres)$", description="sqlite or postgres")
    state_dir: Path | None = Field(
        default=None, description="sqlite: directory of the job store (jobs.sqlite3, mode 0600)"
    )
    postgres_dsn: str | None = Field(
        default=None, description="postgres: libpq connection string of the database replicas share"
    )
    classes: tuple[str, ...] = Field(
        default=("batch",), min_length=1, description="classes jobs may run in (each deferred at step 4)"
    )
    default_class: str = "batch"
    max_queued_per_tenant: int = Field(default=10_000, ge=1, description="unfinished items per tenant")
    max_payload_bytes: int = Field(default=4 * 1024 * 1024, ge=1024, description="one request or JSONL")
    max_batch_items: int = Field(default=50_000, ge=1)
    default_complete_within_s: float = Field(default=86_400.0, gt=0)
    max_complete_within_s: float = Field(default=7 * 86_400.0, gt=0)
    max_attempts: int = Field(default=3, ge=1, description="counted attempts per item")
    backoff_base_s: float = Field(default=0.5, gt=0)
    backoff_max_s: float = Field(default=60.0, gt=0)
    result_retention_s: float = Field(default=7 * 86_400.0, gt=0, description="results kept after finish")
    item_deadline_s: float = Field(default=30.0, gt=0, description="per-item deadline (stragglers retry)")
    lease_s: float = Field(default=30.0, gt=0, description="a running item's claim; renewed while it runs")
    max_inflight: int = Field(default=8, ge=1, description="items one gateway runs at once")
    trough_fill: float = Field(
        default=0.9, gt=0, le=1, description="share of the idle protected capacity job work may use"
    )
    max_wait_s: float = Field(default=300.0, gt=0, description="bound of one Wait stream")
    poll_s: float = Field(
        default=0.05,
        gt=0,
        description="runner's interval while items run or wait ready (paced out by the trough, "
        "deferred at step 4): how soon a load dip starts held work",
    )
    idle_poll_s: float = Field(
        default=1.0,
        gt=0,
        description="runner's longest wait with nothing ready or running (it wakes at once for "
        "this gateway's submissions and at the store's next due time): how late it sees work "
        "another replica submitted (postgres)",
    )

    @model_validator(mode="after")
    def _store(self) -> JobsConfig:
        if self.store == "sqlite" and self.state_dir is None:
            raise ValueError("store sqlite needs state_dir")
        if self.store == "postgres" and not self.postgres_dsn:
            raise ValueError("store postgres needs postgres_dsn")
        if self.idle_poll_s < self.poll_s:
            raise ValueError("idle_poll_s must be at least poll_s")
        return self


class StateConfig(_Strict):
    """Where quota ledgers and fleet membership live (``gateway/state/``).

    ``memory``: this process only (the default: one replica). ``redis``: shared by every
    replica configured with the same ``url`` and ``key_prefix``; see docs/operators.md
    "Running a fleet"."""

    backend: Literal["memory", "redis"] = "memory"
    url: str | None = Field(
        default=None,
        pattern=r"^redis://[^/:]+(:[0-9]{1,5})?(/[0-9]+)?$",
        description="redis://HOST[:PORT][/DB]; required with backend: redis",
    )
    key_prefix: str = Field(default="orchid:", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    fail_mode: Literal["local", "closed"] = Field(
        default="local",
        description="Redis unreachable: local = each replica keeps 1/N of every quota (N from the "
        "last known membership); closed = refuse with UNAVAILABLE",
    )
    lease_ttl_ms: int = Field(
        default=3000,
        ge=200,
        le=60000,
        description="life of a reservation's lease and a replica's heartbeat unless renewed "
        "(renewed every lease_ttl_ms / 3)",
    )
    call_timeout_ms: int = Field(default=100, ge=5, le=10000, description="deadline of every Redis call")
    quota_slice: float = Field(
        default=0.05,
        ge=0.0,
        le=0.25,
        description="share of an account's bursts (accelerator-ms and live-token-ms, and of its "
        "max_concurrent) a replica claims from Redis in one reservation and admits on locally; "
        "0 = one Redis round trip per request",
    )

    @model_validator(mode="after")
    def _url_for_redis(self) -> StateConfig:
        if self.backend == "redis" and self.url is None:
            raise ValueError("backend redis needs url (redis://HOST:PORT/DB)")
        if self.backend == "memory" and self.url is not None:
            raise ValueError("url is only read with backend: redis")
        if self.call_timeout_ms * 3 > self.lease_ttl_ms:
            raise ValueError("call_timeout_ms must be at most a third of lease_ttl_ms")
        return self


class FeatureSourceConfig(_Strict):
    """A feature source the routes' feature contracts read (``gateway.features``): a Feast
    feature server's HTTP endpoint and its registry file (where the definition versions are)."""

    url: str = Field(pattern=r"^https?://", description="the feature server (POST /get-online-features)")
    registry: Path | None = Field(
        default=None,
        description="its registry file (Feast's registry.db), read for each feature service's "
        "definition_version tag at load and whenever it changes; None: versions are not checked",
    )
    repo: Path | None = Field(
        default=None,
        description="its Feast feature repository (the directory with feature_store.yaml), for the "
        "point-in-time reads of batch jobs that declare a feature_snapshot (Feast's historical "
        "retrieval, gateway.features.historical); None: such batches are refused",
    )
    timeout_ms: float = Field(
        default=50.0, gt=0, description="a read's longest wait (less if the request's slack is)"
    )
    budget_ms: float = Field(
        default=20.0,
        gt=0,
        description="the read latency it should keep to: over it, new requests are refused early",
    )
    latency_quantile: float = Field(
        default=0.95, gt=0, lt=1, description="of recent reads: the upstream reserve"
    )
    window_s: float = Field(
        default=5.0, gt=0, description="the recent reads the reserve and backpressure judge"
    )
    min_samples: int = Field(
        default=20,
        ge=1,
        description="reads in the window before it may backpressure (20: one slow read is not a p95)",
    )
    probe_interval_s: float = Field(
        default=0.5, gt=0, description="while backpressured, one read per interval"
    )
    max_concurrency: int = Field(
        default=16, ge=1, description="reads in flight at once (one connection each)"
    )
    cache_ttl_ms: float = Field(default=1000.0, ge=0, description="a cached read's longest life; 0: no cache")
    cache_entries: int = Field(default=4096, ge=0)
    backpressure: bool = Field(
        default=True,
        description="the source's latency reaches admission: its measured quantile is the requests' "
        "upstream reserve, and new requests are refused early while it is late or failing; false: "
        "the class's constant reserve, every request reads",
    )


class FeatureRefConfig(_Strict):
    """One feature of a route's contract."""

    ref: str = Field(pattern=r"^[A-Za-z0-9_]+:[A-Za-z0-9_]+$", description="view:feature on the source")
    max_age_s: float = Field(gt=0, description="older values are missing (event time to now)")
    missing: Literal["refuse", "default", "allow"] = "refuse"
    default: float = Field(
        default=0.0, allow_inf_nan=False, description="the value used when missing: default"
    )


class FeatureContractConfig(_Strict):
    """A route's upstream features (``gateway.core.upstream.FeatureContract``)."""

    source: str = Field(description="one of gateway.yaml's feature_sources")
    feature_service: str = Field(min_length=1)
    definition_version: str = Field(min_length=1, description="the version the model was trained on")
    entities: dict[str, str] = Field(min_length=1, description="join key -> request parameter carrying it")
    features: tuple[FeatureRefConfig, ...] = Field(min_length=1)
    input: str = Field(
        min_length=1, description="the model input they reach it as (FP32, declared by the model)"
    )
    max_entities: int = Field(default=16, ge=1, le=1024, description="entities one request may read at most")


class GatewayConfig(_Strict):
    listen: str = "127.0.0.1:8001"
    tenants_file: Path
    routes_dir: Path
    policies_dir: Path
    backends: tuple[BackendConfig, ...] = ()
    local_triton: LocalTritonConfig | None = None
    classes: dict[str, RequestClassConfig]
    default_class: str = "interactive"
    batch_classes: tuple[str, ...] = Field(default=("batch",), description="deferred from ladder step 4")
    limits: LimitsConfig = LimitsConfig()
    policy_engine: str = Field(default="cel-expr", pattern="^(cel-expr|cel-python)$")
    policy_watch_s: float = Field(default=1.0, gt=0, description="how often the policy directory is checked")
    protected_utilization: float = Field(default=0.70, gt=0, le=1)
    ladder: LadderValue = DEFAULT_LADDER
    telemetry: TelemetryConfig = TelemetryConfig()
    tls: TlsConfig | None = None
    risk_classes: tuple[str, ...] = Field(
        default=DEFAULT_RISK_CLASSES,
        min_length=1,
        description="declared risk classes, lowest first (gateway.core.risk)",
    )
    state: StateConfig = Field(
        default=StateConfig(), description="shared state of a fleet of replicas (gateway/state/)"
    )
    jobs: JobsConfig | None = Field(default=None, description="async/batch jobs; None: no jobs service")
    feature_sources: dict[str, FeatureSourceConfig] = Field(
        default_factory=dict, description="feature sources routes' feature contracts read (gateway.features)"
    )
    rollouts_dir: Path | None = Field(
        default=None, description="directory of rollout files (gateway.rollouts); None: no rollouts"
    )
    rollouts_state_dir: Path | None = Field(
        default=None,
        description="where a running rollout's state is kept (one JSON file per rollout, written at "
        "every phase or step change): a restarted gateway resumes it; None: in memory only",
    )

    @model_validator(mode="after")
    def _consistent(self) -> GatewayConfig:
        if not self.backends and self.local_triton is None:
            raise ValueError("configure at least one backend or local_triton")
        if self.default_class not in self.classes:
            raise ValueError(f"default_class {self.default_class!r} is not one of classes")
        names = [b.name for b in self.backends]
        if len(names) != len(set(names)):
            raise ValueError("backend names must be unique")
        if len(self.risk_classes) != len(set(self.risk_classes)):
            raise ValueError("risk_classes must be unique")
        if self.jobs is not None:
            for name in (*self.jobs.classes, self.jobs.default_class):
                if name not in self.classes or name not in self.batch_classes:
                    raise ValueError(f"jobs class {name!r} must be one of classes and of batch_classes")
            if self.jobs.default_class not in self.jobs.classes:
                raise ValueError("jobs.default_class must be one of jobs.classes")
        with_topology = [b.name for b in self.backends if b.topology is not None]
        if self.local_triton is not None and self.local_triton.topology is not None:
            with_topology.append("local")
        if with_topology and self.state.backend != "memory":
            raise ValueError(
                f"backend {with_topology[0]!r} declares a topology, which a fleet of replicas "
                "(state.backend redis) does not schedule yet: its units are held by one replica"
            )
        return self


# --------------------------------------------------------------------------- tenants


class TenantConfig(_Strict):
    """What one tenant may reach. Keys are stored as SHA-256 hex digests, never in clear."""

    key_sha256: tuple[str, ...] = Field(default=(), description="bearer keys (or use client_cert_subjects)")
    models: tuple[str, ...]
    classes: tuple[str, ...]
    cells: tuple[str, ...] = Field(min_length=1)
    default_cell: str | None = None
    max_output_tokens: int = Field(default=4096, ge=1)
    weight: float = Field(default=1.0, gt=0)
    client_cert_subjects: tuple[str, ...] = Field(
        default=(), description="client-certificate common names (mTLS) that identify this tenant"
    )
    dedicated: bool = False
    dedicated_models: dict[str, str] = Field(
        default_factory=dict, description="logical model -> backend model reserved for this tenant"
    )
    allow_fallback: bool = True
    admin: bool = False
    risk_class: str = Field(default="standard", description="minimum risk class of its requests")

    @field_validator("key_sha256")
    @classmethod
    def _hex_digests(cls, keys: tuple[str, ...]) -> tuple[str, ...]:
        for key in keys:
            if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
                raise ValueError("each key must be a lowercase SHA-256 hex digest (64 chars); see docs")
        return keys

    @model_validator(mode="after")
    def _some_credential(self) -> TenantConfig:
        if not self.key_sha256 and not self.client_cert_subjects:
            raise ValueError("a tenant needs key_sha256 or client_cert_subjects")
        return self

    @property
    def home_cell(self) -> str:
        return self.default_cell or self.cells[0]


class TenantsFile(_Strict):
    tenants: dict[str, TenantConfig]
    quotas: QuotaSettingsValue = QuotaSettings()

    @model_validator(mode="after")
    def _unique_keys(self) -> TenantsFile:
        seen: dict[str, str] = {}
        for name, tenant in self.tenants.items():
            for key in tenant.key_sha256:
                if key in seen:
                    raise ValueError(f"tenants {seen[key]!r} and {name!r} share a key")
                seen[key] = name
        return self


def hash_api_key(key: str) -> str:
    """The digest stored in the tenants file. API keys are random and long, so a fast hash is
    the right tool (as for GitHub tokens); use ``orchid-gateway``'s docs to mint one."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------- routes


class ShapeSpec(_Strict):
    """How a request's shape is read from its tensors and parameters (shape extraction as data)."""

    tokens_input: str = Field(description="input tensor whose dims carry the tokens")
    tokens_dim: int = Field(default=-1, description="which dim of that tensor counts tokens")
    items_dim: int | None = Field(default=None, description="which dim counts items (batch); None = 1")
    output_limit_parameter: str | None = Field(
        default="max_output_tokens", description="backend request parameter that receives the output limit"
    )
    default_max_output_tokens: int = Field(default=64, ge=1)
    max_input_tokens: int = Field(default=8192, ge=1)
    max_output_tokens: int = Field(default=1024, ge=1)
    max_items: int = Field(default=8, ge=1)
    long_input_tokens: int = Field(default=1024, ge=1, description="bucket boundary: short vs long")


class QualityEvidence(_Strict):
    """A route's seeded quality evidence (``gateway.evidence`` keeps the live evidence).

    Dates are ISO 8601 (a date, or a date-time; naive means UTC). Without ``evaluated_at``
    the evidence is undated: it holds from startup until a published evaluation replaces it,
    unless ``review_by`` (an absolute date) ends it; ``max_age_days`` needs ``evaluated_at``."""

    population: str
    score: float = Field(ge=0, le=1)
    sample_size: int = Field(default=0, ge=0)
    owner: str = ""
    evaluated_at: str | None = None
    review_by: str | None = None
    max_age_days: float | None = Field(default=None, gt=0)

    @field_validator("evaluated_at", "review_by")
    @classmethod
    def _iso_date(cls, value: str | None) -> str | None:
        if value is not None:
            parse_time(value)
        return value

    @model_validator(mode="after")
    def _age_needs_date(self) -> QualityEvidence:
        if self.max_age_days is not None and self.evaluated_at is None:
            raise ValueError("max_age_days needs evaluated_at (the age is counted from it)")
        return self


def parse_time(text: str) -> float:
    """ISO 8601 date or date-time to Unix seconds (naive: UTC). ValueError if malformed."""
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"not an ISO 8601 date or date-time: {text!r}") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.timestamp()


class ReducedOutput(_Strict):
    """Quality evidence for answering with a capped output (overload ladder step 2)."""

    max_output_tokens: int = Field(ge=1)
    quality: QualityEvidence


class ShadowConfig(_Strict):
    """Duplicate a share of a route's traffic to a candidate version (answers are discarded)."""

    backend_model: str = Field(description="the candidate backend model, warm beside the current one")
    rate: float = Field(gt=0, le=1, description="share of eligible requests duplicated")
    max_inflight: int = Field(default=2, ge=1, description="shadow calls in flight at most; more are skipped")


class PrefixAffinityConfig(_Strict):
    """Prefix-aware routing for a route whose backend model keeps a prefix cache
    (``gateway.core.prefix``; docs/prefix-affinity.md): a request goes to the backend where
    its prompt's prefix is expected to be cached, as long as that backend's predicted wait is
    within ``max_extra_wait_ms`` of the least-loaded one's; otherwise it spills to the
    least-loaded. The cache scope (tenant, privacy cell, model version) is not configurable:
    it is sent whenever the model declares a cache, with or without this block."""

    max_extra_wait_ms: float = Field(
        ge=0, description="how much longer a predicted wait affinity may choose than the least"
    )


class RouteConfig(_Strict):
    """A logical model clients call, mapped onto a backend model."""

    backend_model: str
    version: str = ""
    profile: str
    shape: ShapeSpec
    streaming: bool = False
    fallback: str | None = None
    fallback_classes: tuple[str, ...] = Field(
        default=("interactive",), description="request classes the fallback may serve"
    )
    quality: QualityEvidence | None = None
    quality_floor: float | None = Field(default=None, ge=0, le=1)
    reduced_output: ReducedOutput | None = None
    shadow: ShadowConfig | None = None
    backends: tuple[str, ...] = Field(default=(), description="backend names serving it; empty = all")
    risk_class: str = Field(default="standard", description="minimum risk class of its requests")
    # The route's output contract (``gateway.core.outputs``, the same checks a rollout
    # declares): every answer is checked before it is returned, an invalid one refused with
    # INTERNAL (rule ``output.contract``); a stream's every result (datatype and range: a
    # result's shape is its own), an invalid one never forwarded and its stream ended with
    # that error; empty: not checked.
    outputs: dict[str, OutputCheckValue] = Field(
        default_factory=dict, description="output name -> its checks"
    )
    features: FeatureContractConfig | None = Field(
        default=None, description="upstream features read for each request (gateway.features)"
    )
    prefix_affinity: PrefixAffinityConfig | None = Field(
        default=None, description="route to the backend whose prefix cache holds the prompt"
    )

    def for_tenant(self, model: str, tenant: TenantConfig) -> RouteConfig | None:
        """This route as ``tenant`` runs it. A dedicated tenant runs only on the backend model
        reserved for it (``dedicated_models``), never on the shared one; ``None``: it has none."""
        if not tenant.dedicated:
            return self
        own = tenant.dedicated_models.get(model)
        return None if own is None else self.model_copy(update={"backend_model": own})


class RoutesFile(_Strict):
    profiles: dict[str, DemandProfileValue] = {}
    models: dict[str, RouteConfig] = {}


class RouteTable(_Strict):
    """All route files merged: logical model name -> route, profile name -> profile."""

    profiles: dict[str, DemandProfileValue]
    models: dict[str, RouteConfig]


# --------------------------------------------------------------------------- loading


def _read(path: Path) -> YamlDocument:
    try:
        return read_yaml(path)
    except YamlError as exc:
        raise ConfigError(exc.location, "", exc.problem) from exc


def _validate(model: type[_M], document: YamlDocument) -> _M:
    data = document.value()
    if not isinstance(data, dict):
        raise ConfigError(document.location(), "", "expected a mapping at the top level")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        loc = errors[0]["loc"]
        problem = errors[0]["msg"]
        if len(errors) > 1:
            problem += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
        raise _at(document, loc, problem) from exc


def _at(document: YamlDocument, loc: KeyPath, problem: str, *, key: str | None = None) -> ConfigError:
    """A ``ConfigError`` at the key ``loc`` of a loaded document."""
    return ConfigError(document.location(loc), key_path(loc) if key is None else key, problem)


def _error_at(path: Path, loc: KeyPath, problem: str, *, key: str | None = None) -> ConfigError:
    """A ``ConfigError`` found after loading (a cross-file check), located at ``loc`` in ``path``
    (the file is read again to find it: only on the error path)."""
    try:
        document = read_yaml(path)
    except YamlError:
        return ConfigError(str(path), key_path(loc) if key is None else key, problem)
    return _at(document, loc, problem, key=key)


def _route_error(directory: Path, loc: KeyPath, problem: str, *, key: str | None = None) -> ConfigError:
    """A route problem, located in the route file that declares ``loc[:2]`` (``models.<name>``)."""
    for file in sorted(directory.glob("*.yaml")):
        try:
            document = read_yaml(file)
        except YamlError:
            continue
        if document.has(loc[:2]):
            return _at(document, loc, problem, key=key)
    return ConfigError(str(directory), key_path(loc) if key is None else key, problem)


route_error = _route_error  # for cross-file checks of route contracts outside this module


def _resolve(base: Path, value: Path) -> Path:
    return value if value.is_absolute() else (base / value).resolve()


def load_gateway_config(path: Path) -> GatewayConfig:
    config = _validate(GatewayConfig, _read(path))
    base = path.resolve().parent
    local = config.local_triton
    if local is not None:
        local = local.model_copy(update={"model_repository": _resolve(base, local.model_repository)})
    return config.model_copy(
        update={
            "tenants_file": _resolve(base, config.tenants_file),
            "routes_dir": _resolve(base, config.routes_dir),
            "policies_dir": _resolve(base, config.policies_dir),
            "tls": (
                config.tls.model_copy(
                    update={
                        "cert_file": _resolve(base, config.tls.cert_file),
                        "key_file": _resolve(base, config.tls.key_file),
                        "client_ca_file": _resolve(base, config.tls.client_ca_file)
                        if config.tls.client_ca_file
                        else None,
                    }
                )
                if config.tls
                else None
            ),
            "local_triton": local,
            "feature_sources": {
                name: source.model_copy(
                    update={
                        "registry": _resolve(base, source.registry) if source.registry else None,
                        "repo": _resolve(base, source.repo) if source.repo else None,
                    }
                )
                for name, source in config.feature_sources.items()
            },
            "rollouts_dir": _resolve(base, config.rollouts_dir) if config.rollouts_dir else None,
            "rollouts_state_dir": _resolve(base, config.rollouts_state_dir)
            if config.rollouts_state_dir
            else None,
            "jobs": (
                config.jobs.model_copy(update={"state_dir": _resolve(base, config.jobs.state_dir)})
                if config.jobs and config.jobs.state_dir is not None
                else config.jobs
            ),
        }
    )


def load_tenants(path: Path) -> TenantsFile:
    """The tenants file (quota settings included), validated; every problem located."""
    return _validate(TenantsFile, _read(path))


def load_routes(directory: Path) -> RouteTable:
    if not directory.is_dir():
        raise ConfigError(str(directory), "", "routes directory does not exist")
    profiles: dict[str, DemandProfile] = {}
    models: dict[str, RouteConfig] = {}
    files = sorted(directory.glob("*.yaml"))
    if not files:
        raise ConfigError(str(directory), "", "no *.yaml route files")
    declared_in: dict[str, YamlDocument] = {}
    for file in files:
        document = _read(file)
        parsed = _validate(RoutesFile, document)
        for name, profile in parsed.profiles.items():
            if name in profiles:
                raise _at(document, ("profiles", name), "profile declared twice")
            profiles[name] = profile
        for name, route in parsed.models.items():
            if name in models:
                first = declared_in[name].location(("models", name))
                raise _at(document, ("models", name), f"model declared twice (first at {first})")
            models[name] = route
            declared_in[name] = document
    for name, route in models.items():
        if route.profile not in profiles:
            raise _at(declared_in[name], ("models", name, "profile"), f"unknown profile {route.profile!r}")
        if route.fallback is not None and route.fallback not in models:
            raise _at(declared_in[name], ("models", name, "fallback"), f"unknown model {route.fallback!r}")
    return RouteTable(profiles=profiles, models=models)


def check_dedicated(config: GatewayConfig, tenants: TenantsFile, routes: RouteTable) -> None:
    """Dedicated tenants have a reserved backend model for every model they may call, and a
    reserved backend model belongs to one tenant and to no shared route. ``serve`` refuses a
    configuration that breaks this; ``audit isolation`` reports it as a finding instead."""
    shared = {route.backend_model for route in routes.models.values()}
    owners: dict[str, str] = {}
    for name, tenant in tenants.tenants.items():
        for model in tenant.models:
            if tenant.dedicated and model not in tenant.dedicated_models:
                raise _error_at(
                    config.tenants_file,
                    ("tenants", name, "dedicated_models"),
                    f"tenant is dedicated but has no reserved backend model for {model!r}",
                )
        for logical, backend_model in tenant.dedicated_models.items():
            if backend_model in shared or backend_model in owners:
                other = owners.get(backend_model, "a shared route")
                raise _error_at(
                    config.tenants_file,
                    ("tenants", name, "dedicated_models", logical),
                    f"backend model {backend_model!r} is already used by {other}",
                    key=f"tenants.{name}.dedicated_models",
                )
            owners[backend_model] = f"tenant {name!r}"


def check_memory(config: GatewayConfig, routes: RouteTable) -> None:
    """Every route's model fits the devices of the backends that may serve it: its weights and
    workspace beside the runtime reserve within device memory (else no request could run)."""
    memories = {b.name: (b.device_memory_gib, b.runtime_reserve_gib) for b in config.backends}
    if config.local_triton is not None:
        local = config.local_triton
        memories["local"] = (local.device_memory_gib, local.runtime_reserve_gib)
    for route in routes.models.values():
        profile = routes.profiles[route.profile]
        for backend in route.backends or tuple(memories):
            if backend not in memories:
                continue
            device_gib, reserve_gib = memories[backend]
            if DeviceMemory.from_gib(device_gib, reserve_gib).live_room_bytes(resident_bytes(profile)) < 0:
                raise _route_error(
                    config.routes_dir,
                    ("profiles", route.profile, "weights_bytes"),
                    f"weights and workspace ({resident_bytes(profile):,} B) with backend {backend!r}'s "
                    f"runtime reserve ({reserve_gib:g} GiB) exceed its device memory ({device_gib:g} GiB)",
                )


def check_references(config: GatewayConfig, tenants: TenantsFile, routes: RouteTable) -> None:
    """Cross-file checks: tenants name real models and classes; routes name real backends."""
    backend_names = {b.name for b in config.backends} | ({"local"} if config.local_triton else set())
    for name, tenant in tenants.tenants.items():
        for index, model in enumerate(tenant.models):
            if model not in routes.models:
                raise _error_at(
                    config.tenants_file,
                    ("tenants", name, "models", index),
                    f"unknown model {model!r}",
                    key=f"tenants.{name}.models",
                )
        for index, cls in enumerate(tenant.classes):
            if cls not in config.classes:
                raise _error_at(
                    config.tenants_file,
                    ("tenants", name, "classes", index),
                    f"unknown class {cls!r}",
                    key=f"tenants.{name}.classes",
                )

        if tenant.risk_class not in config.risk_classes:
            raise _error_at(
                config.tenants_file,
                ("tenants", name, "risk_class"),
                f"unknown risk class {tenant.risk_class!r} (declared: {', '.join(config.risk_classes)})",
                key=f"tenants.{name}.risk_class",
            )
        if tenant.default_cell is not None and tenant.default_cell not in tenant.cells:
            raise _error_at(
                config.tenants_file, ("tenants", name, "default_cell"), "must be one of the tenant's cells"
            )
    for name in tenants.quotas.tenants:
        if name not in tenants.tenants:
            raise _error_at(config.tenants_file, ("quotas", "tenants", name), "unknown tenant")
    for name, route in routes.models.items():
        if route.risk_class not in config.risk_classes:
            raise _route_error(
                config.routes_dir,
                ("models", name, "risk_class"),
                f"unknown risk class {route.risk_class!r} (declared: {', '.join(config.risk_classes)})",
                key=f"models.{name}.risk_class",
            )
        if route.features is not None and route.features.source not in config.feature_sources:
            raise _route_error(
                config.routes_dir,
                ("models", name, "features", "source"),
                f"unknown feature source {route.features.source!r} "
                f"(declared: {', '.join(config.feature_sources) or 'none'})",
            )
        for index, backend in enumerate(route.backends):
            if backend not in backend_names:
                raise _route_error(
                    config.routes_dir,
                    ("models", name, "backends", index),
                    f"unknown backend {backend!r}",
                    key=f"models.{name}.backends",
                )
