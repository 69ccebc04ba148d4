"""``orchid-gateway demo``: one command from nothing to a working stack and a readable report.

Owns the demo workload and its report. It starts a Feast feature server over a copy of the
example feature repository (``orchid_tools.featurestore.FeastServer``, in a temporary
directory, never the repository's ``examples/`` tree) and points the config's
``feature_sources.feast`` at it, then starts the local stack in-process (a ``GatewayServer``
from the config, which supervises the embedded Triton and opens the job store), waits until the
gateway and its models are ready, and drives the five modes of work through it at once:

* **online**: a short mixed workload with *unmodified* ``tritonclient.grpc`` (the sync
  client from a bounded thread pool, ``tritonclient.grpc.aio`` on the event loop) from the
  demo tenants;
* **streaming**: ``start_stream``/``async_stream_infer`` on the streaming model;
* **features**: online requests to the route ``ranker`` from tenant orchid, each naming a
  ``user_id`` whose features the gateway reads from Feast and judges by the route's feature
  contract: mostly users with fresh values (answered, some from the gateway's feature cache),
  a few for user 7 (values 3 days old: refused as stale) and user 8 (none: refused as missing);
  ``--no-features`` (or no ``feast`` command: ``scripts/bootstrap.sh`` installs it) skips it
  and says so;
* **async**: ``--async-jobs`` requests through ``orchid.jobs.v1.Operations.Submit``;
* **batch**: one JSONL batch of ``--batch-items`` lines through ``SubmitBatch``, with a
  progress bar while it runs (redrawn in place on a terminal, a line per tenth otherwise).

Operations an earlier gateway left unfinished on the same job store (a demo killed with
``kill -9`` mid-batch) are found at start, resumed by the runner and followed to the end too.
Then it prints what happened: a line per mode (the batch's output set checked for one answer
per item), then per tenant and class the online requests admitted, served by a fallback and
rejected (grouped by gRPC status and the deciding ``orchid-rule``), client-side latency
percentiles of admitted requests, and the provenance parameters of one response per model.
Then it shuts the stack down.

The online mix shows what a reviewer wants to see: orchid interactive short (256 input
tokens) and long (4,096) requests, batch-class requests, a streaming model, lumen
interactive shorts, and requests that are wrong on purpose (a model the tenant may not see,
a deadline too tight for a long prompt, an unknown credential, an output limit over the
tenant's cap) so rejections show with their reasons. Arrivals are Poisson at a moderate rate
with a bounded number in flight, so it runs on a two-core machine. The jobs are orchid's, in
its batch class: they run in the capacity the online work leaves (docs/operators.md, "How
jobs run").

The job store is the config's ``jobs:`` block (the example's: SQLite in
``examples/orchid/state/jobs``, created on first start); ``--state-dir DIR`` puts it
elsewhere (SQLite), for instance beside a gateway started by hand on the same config, which
holds the example's directory.

Exit codes: 0 the workload ran, something was admitted and every job completed (each batch
one answer per item); 1 nothing was admitted, or a job did not complete within
``--jobs-timeout`` (it stays in the store and resumes on the next start), or the features
mode was to run and did not (Feast failed to start) or had no request answered; 2 usage or
configuration error; 3 the stack could not start (a job state directory another gateway
holds included).

Nothing here is part of the request path: this module only *uses* the gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import random
import re
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import grpc
import httpx
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from tritonclient.utils import InferenceServerException

from gateway import __version__
from gateway._proto import jobs_pb2, jobs_pb2_grpc
from gateway.backends.local import TritonStartError
from gateway.config import GatewayConfig, JobsConfig, load_gateway_config
from gateway.core.errors import ConfigError
from gateway.jobs.batch import request_from_json
from gateway.jobs.store import StateDirectoryBusy
from gateway.server import GatewayServer
from orchid_tools.featurestore import FeastServer, FeastStartError, feast_executable
from orchid_tools.jobs import Progress

log = logging.getLogger("orchid.demo")

DEFAULT_CONFIG = Path("examples/orchid/gateway.yaml")

# Clear-text demo keys, as printed in examples/orchid/tenants.yaml. DEMO KEYS ONLY.
DEMO_KEYS: dict[str, str] = {
    "orchid": "orchid-demo-key-orchid",
    "lumen": "orchid-demo-key-lumen",
    "ops": "orchid-demo-key-ops",
    "kestrel": "orchid-demo-key-kestrel",
}
UNKNOWN_TENANT = "(unknown)"
UNKNOWN_KEY = "orchid-demo-key-nobody"

# full-v18 at 4,096 input + 64 output tokens, in accelerator-ms at time factor 1 (the seed's figure
# for 128 output tokens is 467.6 ms; the demo's long requests ask for the route default of 64).
LONG_REQUEST_MS = 4.4 + 0.1 * 4096 + 0.41875 * 64

FINAL_PARAMETER = "triton_final_response"
OK = "OK"


# --------------------------------------------------------------------------- workload


@dataclass(frozen=True, slots=True)
class Scenario:
    """One kind of request in the mix."""

    name: str
    tenant: str
    request_class: str
    model: str
    tokens: int
    client: str  # "sync" | "aio" | "stream"
    weight: float
    max_output_tokens: int | None = None
    timeout_s: float | None = None  # gRPC deadline (tritonclient client_timeout); None = class default
    allow_fallback: bool | None = None
    batched: bool = True  # INPUT_IDS is [1, N] (batched models) or [N] (the stream model)
    expect: str = OK  # what a correct gateway answers (deliberately bad requests expect a rejection)

    @property
    def key(self) -> str:
        return DEMO_KEYS.get(self.tenant, UNKNOWN_KEY)

    def parameters(self) -> dict[str, str | int | bool]:
        params: dict[str, str | int | bool] = {"orchid.class": self.request_class}
        if self.max_output_tokens is not None:
            params["orchid.max_output_tokens"] = self.max_output_tokens
        if self.allow_fallback is not None:
            params["orchid.allow_fallback"] = self.allow_fallback
        return params


def build_scenarios(time_factor: float) -> tuple[Scenario, ...]:
    """The demo mix. Deadlines that must relate to execution time scale with the emulator's
    time factor, so the same story plays at any speed: a long request with a sensible deadline
    is admitted, the same request with half its predicted execution time is refused at admission."""
    long_s = LONG_REQUEST_MS * time_factor / 1000.0
    return (
        Scenario(
            "short 256 tok", "orchid", "interactive", "full-v18", 256, "sync", 0.30, allow_fallback=True
        ),
        Scenario(
            "long 4096 tok",
            "orchid",
            "interactive",
            "full-v18",
            4096,
            "aio",
            0.08,
            timeout_s=0.25 + 4.0 * long_s,
        ),
        Scenario("compact 256 tok", "orchid", "interactive", "compact-v11", 256, "sync", 0.05),
        Scenario(
            "stream 256 tok",
            "orchid",
            "interactive",
            "full-v18-stream",
            256,
            "stream",
            0.07,
            max_output_tokens=32,
            batched=False,
        ),
        Scenario("batch 1024 tok", "orchid", "batch", "full-v18", 1024, "aio", 0.08, max_output_tokens=128),
        Scenario("short 256 tok", "lumen", "interactive", "full-v18", 256, "sync", 0.20),
        Scenario("dedicated 256 tok", "kestrel", "interactive", "full-v18", 256, "sync", 0.05),
        # Wrong on purpose: each names the status a correct gateway answers.
        Scenario(
            "compact (not allowed)",
            "lumen",
            "interactive",
            "compact-v11",
            256,
            "sync",
            0.04,
            expect="NOT_FOUND",
        ),
        Scenario(
            "long, tight deadline",
            "orchid",
            "interactive",
            "full-v18",
            4096,
            "aio",
            0.04,
            timeout_s=max(0.002, 0.5 * long_s),
            expect="DEADLINE_EXCEEDED",
        ),
        Scenario(
            "unknown credential",
            UNKNOWN_TENANT,
            "interactive",
            "full-v18",
            256,
            "aio",
            0.03,
            expect="UNAUTHENTICATED",
        ),
        Scenario(
            "output over route cap",
            "lumen",
            "interactive",
            "full-v18",
            256,
            "sync",
            0.03,
            max_output_tokens=2000,
            expect="INVALID_ARGUMENT",
        ),
    )


def token_array(tokens: int, batched: bool, salt: int) -> np.ndarray[Any, np.dtype[np.int32]]:
    data = ((np.arange(tokens, dtype=np.int64) * 31 + salt) % 32000).astype(np.int32)
    return data.reshape(1, tokens) if batched else data


def make_inputs(scenario: Scenario, salt: int) -> list[grpcclient.InferInput]:
    data = token_array(scenario.tokens, scenario.batched, salt)
    tensor = grpcclient.InferInput("INPUT_IDS", list(data.shape), "INT32")
    tensor.set_data_from_numpy(data)
    return [tensor]


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


# --------------------------------------------------------------------------- outcomes


@dataclass(slots=True)
class Outcome:
    """What the client saw for one request."""

    scenario: Scenario
    status: str  # "OK" or a gRPC status name
    latency_s: float
    rule: str = ""  # orchid-rule trailing metadata, when the client could see it
    retry_after_ms: str = ""
    message: str = ""
    provenance: dict[str, str] = field(default_factory=dict)
    first_token_s: float | None = None
    tokens: int = 0

    @property
    def admitted(self) -> bool:
        return self.status == OK

    @property
    def fallback(self) -> bool:
        # orchid.approximation lists every degradation: "fallback" or "fallback,reduced_output".
        return self.admitted and "fallback" in self.provenance.get("orchid.approximation", "").split(",")


def parameter_value(param: Any) -> str:
    kind = param.WhichOneof("parameter_choice")
    if kind is None:
        return ""
    value = getattr(param, kind)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def provenance_of(response: Any) -> dict[str, str]:
    """All ``orchid.*`` response parameters of a ModelInferResponse."""
    return {
        key: parameter_value(value)
        for key, value in sorted(response.parameters.items())
        if key.startswith("orchid.")
    }


_STATUS_NAMES = frozenset(code.name for code in grpc.StatusCode)


def status_name(raw: str | None) -> str:
    """tritonclient reports ``StatusCode.NOT_FOUND``; the summary says ``NOT_FOUND``."""
    if not raw:
        return "UNKNOWN"
    name = raw.rsplit(".", 1)[-1]
    return name if name in _STATUS_NAMES else raw


def _metadata_value(metadata: Iterable[Any] | None, key: str) -> str:
    for item in metadata or ():
        k, v = (item.key, item.value) if hasattr(item, "key") else item
        if k == key:
            return v.decode("latin-1") if isinstance(v, bytes) else str(v)
    return ""


def error_outcome(scenario: Scenario, error: BaseException, latency_s: float) -> Outcome:
    """Turn what tritonclient raised into an outcome.

    tritonclient converts a failed RPC into ``InferenceServerException`` (status + message) inside
    its ``except grpc.RpcError`` block, so the original RPC error is the exception's ``__context__``:
    the trailing metadata (``orchid-rule``, ``retry-after-ms``) is read from there when present.
    """
    if isinstance(error, InferenceServerException):
        status = status_name(error.status())
        message = error.message() or ""
    else:
        status = "CLIENT_ERROR"
        message = f"{type(error).__name__}: {error}"
    rule = retry = ""
    context = error.__context__
    if isinstance(context, grpc.RpcError) and hasattr(context, "trailing_metadata"):
        with contextlib.suppress(Exception):
            trailing = context.trailing_metadata()
            rule = _metadata_value(trailing, "orchid-rule")
            retry = _metadata_value(trailing, "retry-after-ms")
    return Outcome(scenario, status, latency_s, rule=rule, retry_after_ms=retry, message=message)


def stream_error_outcome(scenario: Scenario, error: BaseException, latency_s: float) -> Outcome:
    """A per-request stream error: the gateway writes ``STATUS: message`` into ``error_message``."""
    outcome = error_outcome(scenario, error, latency_s)
    head, sep, rest = outcome.message.partition(":")
    if sep and head.strip() in _STATUS_NAMES:
        outcome.status = head.strip()
        outcome.message = rest.strip()
    elif outcome.status == "UNKNOWN":
        outcome.status = "STREAM_ERROR"
    return outcome


# --------------------------------------------------------------------------- clients


class _SyncClients:
    """One sync ``InferenceServerClient`` per worker thread (a client holds at most one stream)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._local = threading.local()
        self._all: list[grpcclient.InferenceServerClient] = []
        self._lock = threading.Lock()

    def get(self) -> grpcclient.InferenceServerClient:
        client: grpcclient.InferenceServerClient | None = getattr(self._local, "client", None)
        if client is None:
            client = grpcclient.InferenceServerClient(self.url)
            self._local.client = client
            with self._lock:
                self._all.append(client)
        return client

    def close(self) -> None:
        with self._lock:
            clients, self._all = self._all, []
        for client in clients:
            with contextlib.suppress(Exception):
                client.close()


def sync_call(clients: _SyncClients, scenario: Scenario, salt: int) -> Outcome:
    client = clients.get()
    inputs = make_inputs(scenario, salt)
    started = time.perf_counter()
    try:
        result = client.infer(
            scenario.model,
            inputs,
            headers=bearer(scenario.key),
            parameters=scenario.parameters(),
            client_timeout=scenario.timeout_s,
        )
    except Exception as error:
        return error_outcome(scenario, error, time.perf_counter() - started)
    latency = time.perf_counter() - started
    return Outcome(scenario, OK, latency, provenance=provenance_of(result.get_response()))


def stream_call(clients: _SyncClients, scenario: Scenario, salt: int, *, wait_s: float = 30.0) -> Outcome:
    """One streaming generation on its own stream: ``start_stream``, ``async_stream_infer``, wait for
    the final response (``enable_empty_final_response``), ``stop_stream``."""
    client = clients.get()
    done = threading.Event()
    state: dict[str, Any] = {"tokens": 0, "first": None, "final": None, "error": None}
    started = time.perf_counter()

    def callback(result: Any, error: Any) -> None:
        now = time.perf_counter()
        if error is not None:
            if state["error"] is None:
                state["error"] = (error, now - started)
            done.set()
            return
        response = result.get_response()
        if len(response.outputs) > 0:
            state["tokens"] += 1
            if state["first"] is None:
                state["first"] = now - started
        final = response.parameters.get(FINAL_PARAMETER)
        if final is not None and final.bool_param:
            state["final"] = (response, now - started)
            done.set()

    try:
        client.start_stream(
            callback=callback, headers=bearer(scenario.key), stream_timeout=scenario.timeout_s
        )
        client.async_stream_infer(
            scenario.model,
            make_inputs(scenario, salt),
            request_id=f"demo-{salt}",
            parameters=scenario.parameters(),
            enable_empty_final_response=True,
        )
        if not done.wait(wait_s):
            return Outcome(
                scenario,
                "CLIENT_TIMEOUT",
                time.perf_counter() - started,
                message=f"no final response within {wait_s:.0f} s",
            )
    except Exception as error:
        return error_outcome(scenario, error, time.perf_counter() - started)
    finally:
        with contextlib.suppress(Exception):
            client.stop_stream()
    if state["error"] is not None:
        failure, latency = state["error"]
        return stream_error_outcome(scenario, failure, latency)
    response, latency = state["final"]
    return Outcome(
        scenario,
        OK,
        latency,
        provenance=provenance_of(response),
        first_token_s=state["first"],
        tokens=state["tokens"],
    )


async def aio_call(client: aioclient.InferenceServerClient, scenario: Scenario, salt: int) -> Outcome:
    inputs = make_inputs(scenario, salt)
    started = time.perf_counter()
    try:
        result = await client.infer(
            scenario.model,
            inputs,
            headers=bearer(scenario.key),
            parameters=scenario.parameters(),
            client_timeout=scenario.timeout_s,
        )
    except Exception as error:
        return error_outcome(scenario, error, time.perf_counter() - started)
    latency = time.perf_counter() - started
    return Outcome(scenario, OK, latency, provenance=provenance_of(result.get_response()))


@dataclass(frozen=True, slots=True)
class WorkloadSettings:
    duration_s: float
    rate: float  # offered requests per second, all tenants together (Poisson)
    workers: int  # bound on requests in flight (and sync worker threads)
    seed: int
    drain_s: float = 30.0


@dataclass(slots=True)
class WorkloadResult:
    outcomes: list[Outcome]
    offered: int
    elapsed_s: float
    unfinished: int


async def drive(
    address: str,
    scenarios: Sequence[Scenario],
    settings: WorkloadSettings,
    outcomes: list[Outcome] | None = None,
) -> WorkloadResult:
    """Poisson arrivals for ``duration_s``; each arrival picks a scenario and waits for a free slot
    among ``workers`` (so offered load degrades to closed-loop rather than piling up). The first
    arrivals visit every scenario once, in shuffled order, so even a short run shows each kind of
    request; after that scenarios are drawn by weight. Outcomes are appended to ``outcomes``
    (when given) as they arrive."""
    rng = random.Random(settings.seed)
    weights = [s.weight for s in scenarios]
    tour = list(scenarios)
    rng.shuffle(tour)
    loop = asyncio.get_running_loop()
    pool = ThreadPoolExecutor(max_workers=settings.workers, thread_name_prefix="demo-client")
    clients = _SyncClients(address)
    aio = aioclient.InferenceServerClient(address)
    slots = asyncio.Semaphore(settings.workers)
    tasks: set[asyncio.Task[Outcome]] = set()
    outcomes = [] if outcomes is None else outcomes  # the caller's list: it may watch it grow

    async def one(scenario: Scenario, salt: int) -> Outcome:
        try:
            if scenario.client == "aio":
                return await aio_call(aio, scenario, salt)
            call: Callable[[_SyncClients, Scenario, int], Outcome] = (
                stream_call if scenario.client == "stream" else sync_call
            )
            return await loop.run_in_executor(pool, call, clients, scenario, salt)
        except Exception as error:  # a client-side failure is an outcome too, never a lost request
            return error_outcome(scenario, error, 0.0)
        finally:
            slots.release()

    started = time.perf_counter()
    end = started + settings.duration_s
    offered = 0
    next_at = started + rng.expovariate(settings.rate)
    try:
        while next_at < end:
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            await slots.acquire()
            scenario = tour.pop() if tour else rng.choices(scenarios, weights)[0]
            offered += 1
            task = loop.create_task(one(scenario, offered))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            task.add_done_callback(lambda t: outcomes.append(t.result()) if not t.cancelled() else None)
            next_at += rng.expovariate(settings.rate)
        unfinished = 0
        if tasks:
            _, pending = await asyncio.wait(set(tasks), timeout=settings.drain_s)
            unfinished = len(pending)
            for task in pending:
                task.cancel()
        elapsed = time.perf_counter() - started
    finally:
        with contextlib.suppress(Exception):
            await aio.close()
        # Worker threads blocked on a call are released when the server stops; don't wait here.
        pool.shutdown(wait=False, cancel_futures=True)
        clients.close()
    return WorkloadResult(outcomes, offered, elapsed, unfinished)


# --------------------------------------------------------------------------- features

FEATURE_SOURCE = "feast"  # the example config's feature source, the one the demo starts
FEATURE_MODEL = "ranker"  # the example route with a feature contract (routes/orchid.yaml)
FEATURE_TENANT = "orchid"
FEATURE_SERVICE = "ranker_v12"  # the route's feature service (its features: block)
FEATURE_INPUT_TOKENS = 16
# The example feature repository's users (examples/orchid/features/README.md): 1..50 have
# values 1 h old; user 7's only row is 3 days old (the contract refuses it: stale), user 8 has
# none (refused: missing).
FEATURE_USERS = range(1, 51)
STALE_USER = 7
MISSING_USER = 8
FRESH_USERS = tuple(u for u in FEATURE_USERS if u not in (STALE_USER, MISSING_USER))
FEATURES_RATE = 8.0  # ranker requests per second (--features-rate)
RULE_STALE = "features.stale"  # the orchid-rule of the contract's refusals (gateway.core.upstream)
RULE_MISSING = "features.missing"
FEATURE_SCENARIO = Scenario(
    "ranker user_id", FEATURE_TENANT, "interactive", FEATURE_MODEL, FEATURE_INPUT_TOKENS, "aio", 0.0
)


@dataclass(frozen=True, slots=True)
class FeatureSettings:
    """The features mode: ranker requests for the demo's duration, Poisson at ``rate`` with at
    most ``workers`` in flight. A share ``stale_share`` asks for user 7 and ``missing_share``
    for user 8; the rest for fresh users, the lower ids more often (so some reads repeat within
    the gateway's cache life). ``skip`` says why the mode does not run ("": it runs)."""

    rate: float = FEATURES_RATE
    workers: int = 4
    seed: int = 7
    stale_share: float = 0.06
    missing_share: float = 0.04
    skip: str = ""


@dataclass(frozen=True, slots=True)
class FeatureOutcome:
    user: int
    outcome: Outcome

    @property
    def refusal(self) -> str:
        """Why the gateway refused it: "stale", "missing" (the contract), else the deciding rule
        (``features.`` left off) or the status; "" when it was answered."""
        o = self.outcome
        if o.admitted:
            return ""
        if o.rule == RULE_STALE:
            return "stale"
        if o.rule == RULE_MISSING:
            return "missing"
        return o.rule.removeprefix("features.") if o.rule else o.status

    @property
    def against_contract(self) -> bool:
        """Answered for user 7 or 8, or refused by the contract for the wrong reason (a fresh user
        as stale or missing, user 7 as missing, user 8 as stale). A refusal for another reason (the
        source late or failing) says nothing about the contract."""
        expected = {STALE_USER: "stale", MISSING_USER: "missing"}.get(self.user, "")
        if self.outcome.admitted:
            return expected != ""
        return self.refusal in ("stale", "missing") and self.refusal != expected


@dataclass(slots=True)
class FeaturesResult:
    source: str  # where the features come from, in words
    outcomes: list[FeatureOutcome] = field(default_factory=list)
    offered: int = 0
    elapsed_s: float = 0.0
    unfinished: int = 0

    @property
    def answered(self) -> list[FeatureOutcome]:
        return [f for f in self.outcomes if f.outcome.admitted]


def feature_user(rng: random.Random, settings: FeatureSettings) -> int:
    draw = rng.random()
    if draw < settings.stale_share:
        return STALE_USER
    if draw < settings.stale_share + settings.missing_share:
        return MISSING_USER
    return rng.choices(FRESH_USERS, [1.0 / (i + 1) for i in range(len(FRESH_USERS))])[0]


def feature_config(
    config: GatewayConfig, url: str, registry: Path, repo: Path | None = None
) -> GatewayConfig:
    """The config with its ``feature_sources.feast`` pointed at a running feature server (and,
    with ``repo``, its feature repository: a snapshot batch's historical reads)."""
    sources = dict(config.feature_sources)
    source = sources.get(FEATURE_SOURCE)
    if source is None:
        raise ConfigError("feature_sources", "", f"the config has no feature source {FEATURE_SOURCE!r}")
    update: dict[str, object] = {"url": url, "registry": registry.resolve()}
    if repo is not None:
        update["repo"] = repo.resolve()
    sources[FEATURE_SOURCE] = source.model_copy(update=update)
    return config.model_copy(update={"feature_sources": sources})


def warm_feast(url: str, reads: int = 3) -> None:
    """A few reads straight from the feature server before the workload, so its first (cold)
    read is not one of the demo's: the route's feature service for a fresh user."""
    with httpx.Client(timeout=10.0) as client:
        for user in FRESH_USERS[:reads]:
            with contextlib.suppress(httpx.HTTPError):
                client.post(
                    f"{url}/get-online-features",
                    json={"feature_service": FEATURE_SERVICE, "entities": {"user_id": [user]}},
                )


def features_skip_reason(config: GatewayConfig, no_features: bool) -> str:
    """Why the features mode will not run ("" when it will)."""
    if no_features:
        return "--no-features"
    if FEATURE_SOURCE not in config.feature_sources:
        return f"the config has no feature_sources.{FEATURE_SOURCE}"
    feast = feast_executable()
    if not feast.exists():
        return (
            f"Feast is not installed ({feast} is missing; scripts/bootstrap.sh installs the features "
            "extra: pip install -e '.[features]')"
        )
    return ""


async def feature_call(client: aioclient.InferenceServerClient, user: int, salt: int) -> FeatureOutcome:
    """One ranker request for ``user`` with unmodified ``tritonclient.grpc.aio``."""
    scenario = FEATURE_SCENARIO
    inputs = make_inputs(scenario, salt)
    started = time.perf_counter()
    try:
        result = await client.infer(
            scenario.model,
            inputs,
            headers=bearer(scenario.key),
            parameters={**scenario.parameters(), "user_id": user},
        )
    except Exception as error:
        return FeatureOutcome(user, error_outcome(scenario, error, time.perf_counter() - started))
    latency = time.perf_counter() - started
    return FeatureOutcome(
        user, Outcome(scenario, OK, latency, provenance=provenance_of(result.get_response()))
    )


async def drive_features(
    address: str, settings: FeatureSettings, duration_s: float, result: FeaturesResult, drain_s: float = 30.0
) -> FeaturesResult:
    """Poisson arrivals of ranker requests for ``duration_s``, at most ``settings.workers`` in
    flight. The first three ask for user 1, 7 and 8 (shuffled), so even a short run shows an
    answer and both refusals; then users are drawn (``feature_user``)."""
    rng = random.Random(settings.seed)
    tour = [1, STALE_USER, MISSING_USER]
    rng.shuffle(tour)
    loop = asyncio.get_running_loop()
    client = aioclient.InferenceServerClient(address)
    slots = asyncio.Semaphore(settings.workers)
    tasks: set[asyncio.Task[FeatureOutcome]] = set()

    async def one(user: int, salt: int) -> FeatureOutcome:
        try:
            return await feature_call(client, user, salt)
        finally:
            slots.release()

    started = time.perf_counter()
    end = started + duration_s
    next_at = started
    try:
        while next_at < end:
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            await slots.acquire()
            user = tour.pop() if tour else feature_user(rng, settings)
            result.offered += 1
            task = loop.create_task(one(user, 50_000 + result.offered))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            task.add_done_callback(
                lambda t: result.outcomes.append(t.result()) if not t.cancelled() else None
            )
            next_at += rng.expovariate(settings.rate)
        if tasks:
            _, pending = await asyncio.wait(set(tasks), timeout=drain_s)
            result.unfinished = len(pending)
            for task in pending:
                task.cancel()
        result.elapsed_s = time.perf_counter() - started
    finally:
        with contextlib.suppress(Exception):
            await client.close()
    return result


def summarize_features(result: FeaturesResult | None, skipped: str = "") -> str:
    """The features mode's line: requests, answered, the cache's share of the answers, refusals
    by reason, p50 latency of the answers, one answer's snapshot provenance."""
    head = "  features   "
    if result is None:
        return f"{head}skipped: {skipped or 'not run'}"
    outcomes = result.outcomes
    answered = result.answered
    cached = sum(f.outcome.provenance.get("orchid.feature_cached") == "true" for f in answered)
    share = f"{100.0 * cached / len(answered):.0f} %" if answered else "-"
    reasons = Counter(f.refusal for f in outcomes if f.refusal)
    order = {"stale": 0, "missing": 1}
    refused = ", ".join(
        f"{reason} {count}"
        for reason, count in sorted(reasons.items(), key=lambda kv: (order.get(kv[0], 2), -kv[1], kv[0]))
    )
    latency = [f.outcome.latency_s for f in answered]
    text = (
        f"{head}{len(outcomes)} {FEATURE_MODEL} requests over {len({f.user for f in outcomes})} users "
        f"(tenant {FEATURE_TENANT}, {result.source}), {len(answered)} answered, {share} of them from "
        f"the feature cache; refused: {refused or 'none'}; p50 {_ms(percentile(latency, 50))} ms"
    )
    sample = next((f for f in answered if f.outcome.provenance.get("orchid.feature_snapshot")), None)
    if sample is not None:
        text += (
            f"; provenance (user {sample.user}) orchid.feature_snapshot "
            f"{sample.outcome.provenance['orchid.feature_snapshot']}"
        )
    if result.unfinished:
        text += f"; {result.unfinished} unfinished at shutdown"
    surprises = sum(f.against_contract for f in outcomes)
    if surprises:
        text += f"; NOTE {surprises} answered against the contract (user 7 stale, 8 missing, others fresh)"
    return text


# --------------------------------------------------------------------------- report


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


_NUMBER = re.compile(r"(?<![\w.-])\d+(?:\.\d+)?")


def reason_of(outcome: Outcome) -> str:
    """How rejections are grouped: the deciding rule when the client saw one, else the message
    with its numbers blanked (so '512 exceeds ... 256' and '600 exceeds ... 256' group together)."""
    if outcome.rule:
        return f"rule {outcome.rule}"
    text = _NUMBER.sub("#", outcome.message.strip()) or "(no message)"
    return text if len(text) <= 72 else text[:69] + "..."


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value * 1000.0:.1f}"


def _table(rows: Sequence[Sequence[str]], right: frozenset[int] = frozenset()) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [cell.rjust(widths[i]) if i in right else cell.ljust(widths[i]) for i, cell in enumerate(row)]
        lines.append("  " + "  ".join(cells).rstrip())
    return lines


def summarize(result: WorkloadResult, settings: WorkloadSettings) -> str:
    outcomes = result.outcomes
    lines: list[str] = []
    admitted = sum(o.admitted for o in outcomes)
    lines.append(
        f"workload: {result.offered} requests offered in {result.elapsed_s:.1f} s "
        f"(Poisson {settings.rate:g} req/s, at most {settings.workers} in flight, seed {settings.seed}); "
        f"{len(outcomes)} answered, {admitted} admitted"
        + (f", {result.unfinished} unfinished at shutdown" if result.unfinished else "")
    )

    # Per tenant/class, then per scenario within it.
    groups: dict[tuple[str, str], list[Outcome]] = defaultdict(list)
    for o in outcomes:
        groups[(o.scenario.tenant, o.scenario.request_class)].append(o)
    header = (
        "tenant/class",
        "requests",
        "sent",
        "admitted",
        "fallback",
        "rejected",
        "p50 ms",
        "p95 ms",
        "p99 ms",
    )
    rows: list[tuple[str, ...]] = [header]

    def row(label: str, name: str, items: list[Outcome]) -> tuple[str, ...]:
        ok = [o.latency_s for o in items if o.admitted]
        return (
            label,
            name,
            str(len(items)),
            str(len(ok)),
            str(sum(o.fallback for o in items)),
            str(sum(not o.admitted for o in items)),
            _ms(percentile(ok, 50)),
            _ms(percentile(ok, 95)),
            _ms(percentile(ok, 99)),
        )

    for (tenant, cls), items in sorted(groups.items()):
        rows.append(row(f"{tenant}/{cls}", "(all)", items))
        by_scenario: dict[str, list[Outcome]] = defaultdict(list)
        for o in items:
            by_scenario[f"{o.scenario.name} -> {o.scenario.model}"].append(o)
        for name, scenario_items in sorted(by_scenario.items()):
            rows.append(row("", name, scenario_items))
    lines.append("")
    lines.append("per tenant / class (latency: client-side, admitted requests only)")
    lines.extend(_table(rows, right=frozenset(range(2, 9))))

    streams = [o for o in outcomes if o.admitted and o.first_token_s is not None]
    if streams:
        ttft = [o.first_token_s for o in streams if o.first_token_s is not None]
        lines.append(
            f"  streams: {len(streams)} completed, {sum(o.tokens for o in streams)} tokens; "
            f"time to first token p50 {_ms(percentile(ttft, 50))} ms, p95 {_ms(percentile(ttft, 95))} ms"
        )

    rejected = [o for o in outcomes if not o.admitted]
    lines.append("")
    if rejected:
        lines.append("rejections by gRPC status and orchid-rule (or reason)")
        counts: Counter[tuple[str, str, str]] = Counter()
        samples: dict[tuple[str, str, str], Outcome] = {}
        for o in rejected:
            key = (f"{o.scenario.tenant}/{o.scenario.request_class}", o.status, reason_of(o))
            counts[key] += 1
            samples.setdefault(key, o)
        reject_rows: list[tuple[str, ...]] = [
            ("tenant/class", "status", "count", "rule / reason", "on purpose")
        ]
        for key, count in sorted(counts.items(), key=lambda kv: (kv[0][0], -kv[1], kv[0][1])):
            sample = samples[key]
            on_purpose = sample.scenario.name if sample.scenario.expect == sample.status else ""
            reject_rows.append((key[0], key[1], str(count), key[2], on_purpose))
        lines.extend(_table(reject_rows, right=frozenset({2})))
        lines.append("  sample messages:")
        seen: set[tuple[str, str]] = set()
        for key in sorted(counts):
            sample = samples[key]
            if (key[1], key[2]) in seen:
                continue
            seen.add((key[1], key[2]))
            extra = f" [retry-after-ms {sample.retry_after_ms}]" if sample.retry_after_ms else ""
            lines.append(f"    {key[1]}: {sample.message}{extra}")
        unexpected = [o for o in outcomes if o.scenario.expect != OK and o.status != o.scenario.expect]
        if unexpected:
            names = Counter(f"{o.scenario.name} got {o.status}" for o in unexpected)
            lines.append(
                "  NOTE deliberately bad requests answered differently than expected: "
                + "; ".join(f"{k} x{v}" for k, v in sorted(names.items()))
            )
    else:
        lines.append("rejections: none")

    lines.append("")
    lines.append("provenance sample (orchid.* response parameters, one response per model)")
    sampled: dict[str, Outcome] = {}
    for o in outcomes:
        if o.admitted and o.provenance:
            sampled.setdefault(o.scenario.model, o)
    if not sampled:
        lines.append("  (no admitted responses)")
    for model, o in sorted(sampled.items()):
        lines.append(f"  {model} ({o.scenario.tenant}/{o.scenario.request_class}, {o.scenario.name}):")
        width = max(len(k) for k in o.provenance)
        for name, value in o.provenance.items():
            lines.append(f"    {name.ljust(width)}  {value if value else '(empty)'}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- async and batch

JOB_TENANT = "orchid"  # the demo's jobs are orchid's, in its batch class (its batch quota)
JOB_MODEL = "full-v18"
JOB_INPUT_TOKENS = 256
JOB_OUTPUT_TOKENS = 16
DONE = frozenset({"completed", "failed", "expired", "cancelled"})
MAX_ASYNC_JOBS = 100


def job_body(salt: int) -> dict[str, Any]:
    """One KServe v2 JSON request body, as ``orchid-gateway jobs submit`` and a JSONL line take it."""
    data = token_array(JOB_INPUT_TOKENS, True, salt)
    return {
        "inputs": [
            {
                "name": "INPUT_IDS",
                "datatype": "INT32",
                "shape": list(data.shape),
                "data": data.ravel().tolist(),
            }
        ],
        "parameters": {"orchid.max_output_tokens": JOB_OUTPUT_TOKENS},
    }


def batch_jsonl(items: int, tag: str) -> bytes:
    """The demo's batch: ``items`` lines with custom ids ``TAG-0`` ... (what ``batch submit`` sends)."""
    lines = (json.dumps({"custom_id": f"{tag}-{i}", **job_body(10_000 + i)}) for i in range(items))
    return ("\n".join(lines) + "\n").encode()


@dataclass(frozen=True, slots=True)
class JobsSettings:
    async_jobs: int  # asynchronous requests (Submit), 0: none
    batch_items: int  # lines of the batch (SubmitBatch), 0: no batch
    timeout_s: float  # how long the demo waits for its jobs after submitting them


@dataclass(slots=True)
class AsyncResult:
    op: jobs_pb2.Operation
    latency_s: float | None  # submit to done, None when not done in time


@dataclass(slots=True)
class BatchResult:
    op: jobs_pb2.Operation
    elapsed_s: float
    items: list[jobs_pb2.BatchItem] = field(default_factory=list)
    earlier: bool = False  # left unfinished by an earlier run, resumed by this one

    @property
    def exactly_once(self) -> bool:
        """One line per item of the output set, every custom id once, each item succeeded."""
        ids = [item.custom_id for item in self.items]
        return (
            self.op.status == "completed"
            and len(ids) == self.op.counts.total
            and len(set(ids)) == len(ids)
            and all(item.status == "succeeded" for item in self.items)
        )


@dataclass(slots=True)
class JobsResult:
    store: str  # where the jobs are kept, in words
    async_results: list[AsyncResult] = field(default_factory=list)
    batches: list[BatchResult] = field(default_factory=list)
    note: str = ""  # why a mode did not run

    @property
    def unfinished(self) -> list[str]:
        ops = [r.op for r in self.async_results] + [b.op for b in self.batches]
        return [f"{op.id} ({op.kind}: {op.status})" for op in ops if op.status != "completed"]


class JobsClient:
    """``orchid.jobs.v1.Operations`` on the event loop, as the demo tenant."""

    def __init__(self, address: str, key: str) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = jobs_pb2_grpc.OperationsStub(self.channel)  # type: ignore[no-untyped-call]
        self.metadata = (("authorization", f"Bearer {key}"),)

    async def close(self) -> None:
        await self.channel.close()

    async def unfinished(self) -> list[jobs_pb2.Operation]:
        """Operations an earlier gateway on this store left unfinished (newest 100)."""
        reply = await self.stub.List(jobs_pb2.ListRequest(page_size=100), metadata=self.metadata, timeout=30)
        return [op for op in reply.operations if op.status not in DONE]

    async def submit_batch(self, items: int) -> jobs_pb2.Operation:
        tag = f"demo-{int(time.time())}"
        request = jobs_pb2.SubmitBatchRequest(jsonl=batch_jsonl(items, tag), model=JOB_MODEL)
        op: jobs_pb2.Operation = await self.stub.SubmitBatch(request, metadata=self.metadata, timeout=60)
        return op

    async def submit(self, salt: int) -> jobs_pb2.Operation:
        body = request_from_json(job_body(salt), JOB_MODEL, "request")
        request = jobs_pb2.SubmitRequest(infer_request=body.SerializeToString())
        op: jobs_pb2.Operation = await self.stub.Submit(request, metadata=self.metadata, timeout=30)
        return op

    async def follow(
        self,
        op: jobs_pb2.Operation,
        deadline: float,
        on_update: Callable[[jobs_pb2.Operation], None] | None = None,
    ) -> jobs_pb2.Operation:
        """The operation's states (``Wait``, reconnecting when a stream's bound ends) until it is
        done or ``deadline`` (monotonic) passes; its last state."""
        last = op
        while last.status not in DONE:
            remaining = deadline - time.monotonic()
            if remaining <= 0.5:
                break
            try:
                async for update in self.stub.Wait(
                    jobs_pb2.GetRequest(id=op.id), metadata=self.metadata, timeout=remaining
                ):
                    last = update
                    if on_update is not None:
                        on_update(update)
            except grpc.aio.AioRpcError as error:
                if error.code() is not grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
        return last

    async def output(self, op_id: str) -> list[jobs_pb2.BatchItem]:
        items: list[jobs_pb2.BatchItem] = []
        token = ""
        while True:
            page = await self.stub.ReadBatchOutput(
                jobs_pb2.ReadBatchOutputRequest(id=op_id, page_size=1000, page_token=token),
                metadata=self.metadata,
                timeout=60,
            )
            items.extend(page.items)
            token = page.next_page_token
            if not token:
                return items


class JobsRun:
    """The demo's asynchronous and batch work: submitted when the online load starts, followed
    while it runs (the batch's progress bar on ``out``), waited for after it (bounded)."""

    def __init__(self, address: str, settings: JobsSettings, store: str, out: TextIO) -> None:
        self.client = JobsClient(address, DEMO_KEYS[JOB_TENANT])
        self.settings = settings
        self.out = out
        self.result = JobsResult(store)
        self.online: list[Outcome] = []  # the online workload's outcomes, for the bar's suffix

    async def run(self) -> JobsResult:
        """Submit, follow until done or the timeout (counted from the submissions). A refusal
        (say the tenant's bound on unfinished items) ends the jobs part and is reported."""
        try:
            return await self._run()
        except grpc.aio.AioRpcError as error:
            self.result.note = f"{error.code().name}: {error.details()}"
            print(f"jobs: {self.result.note}", file=self.out, flush=True)
            return self.result

    async def _run(self) -> JobsResult:
        settings = self.settings
        earlier = await self.client.unfinished()
        if earlier:
            print(
                f"resuming {len(earlier)} operation(s) an earlier gateway left unfinished on this store: "
                + ", ".join(f"{op.id} ({op.kind}, {op.status})" for op in earlier),
                file=self.out,
                flush=True,
            )
        started = time.monotonic()
        # The async requests first: within a (tenant, model) the runner takes items oldest first.
        submitted = [
            (await self.client.submit(salt), time.monotonic()) for salt in range(settings.async_jobs)
        ]
        batch = await self.client.submit_batch(settings.batch_items) if settings.batch_items else None
        print(
            f"submitted: {len(submitted)} async requests (Submit)"
            + (
                f", batch {batch.id} of {settings.batch_items} items of {JOB_MODEL} (SubmitBatch, "
                f"class {batch.request_class})"
                if batch is not None
                else ""
            ),
            file=self.out,
            flush=True,
        )
        deadline = started + settings.timeout_s
        async_tasks = [asyncio.ensure_future(self._one_async(op, at, deadline)) for op, at in submitted]
        for op in earlier:
            self.result.batches.append(await self._batch(op, deadline, time.monotonic(), earlier=True))
        if batch is not None:
            self.result.batches.append(await self._batch(batch, deadline, started, earlier=False))
        self.result.async_results = list(await asyncio.gather(*async_tasks))
        return self.result

    async def _one_async(self, op: jobs_pb2.Operation, submitted_at: float, deadline: float) -> AsyncResult:
        last = await self.client.follow(op, deadline)
        return AsyncResult(last, time.monotonic() - submitted_at if last.status in DONE else None)

    async def _batch(
        self, op: jobs_pb2.Operation, deadline: float, started: float, *, earlier: bool
    ) -> BatchResult:
        """Follow one operation with a progress bar; a batch's output set once it is done."""
        progress = Progress(self.out, label=f"{'earlier ' if earlier else ''}{op.kind} ")

        def show(update: jobs_pb2.Operation) -> None:
            answered = len(self.online)
            progress.update_from(update, f" | online: {answered} answered" if answered else "")

        try:
            last = await self.client.follow(op, deadline, show)
        finally:
            progress.close()
        result = BatchResult(last, time.monotonic() - started, earlier=earlier)
        if last.kind == "batch" and last.status in DONE:
            result.items = await self.client.output(last.id)
        return result


def _seconds(values: Sequence[float], q: float) -> str:
    value = percentile(values, q)
    return "-" if math.isnan(value) else f"{value:.2f} s"


def summarize_modes(online: WorkloadResult, jobs: JobsResult | None, features: str | None = None) -> str:
    """One line per mode: online, streaming, features (``features``: its line, from
    ``summarize_features``; None: no such line), async, batch (and what an earlier run left)."""
    lines = ["five modes" if features is not None else "four modes"]
    unary = [o for o in online.outcomes if o.scenario.client != "stream"]
    ok = [o.latency_s for o in unary if o.admitted]
    lines.append(
        f"  online     {len(unary)} requests (tritonclient sync and aio), {len(ok)} admitted; "
        f"p50 {_ms(percentile(ok, 50))} ms, p95 {_ms(percentile(ok, 95))} ms"
    )
    streams = [o for o in online.outcomes if o.scenario.client == "stream"]
    done = [o for o in streams if o.admitted]
    ttft = [o.first_token_s for o in done if o.first_token_s is not None]
    lines.append(
        f"  streaming  {len(streams)} streams, {len(done)} completed, {sum(o.tokens for o in done)} tokens; "
        f"time to first token p50 {_ms(percentile(ttft, 50))} ms"
    )
    if features is not None:
        lines.append(features)
    if jobs is None:
        lines.append("  async      not run: the gateway serves no jobs (no `jobs:` block in its config)")
        lines.append("  batch      not run: the gateway serves no jobs (no `jobs:` block in its config)")
        return "\n".join(lines)
    if jobs.note:
        lines.append(f"  jobs       refused: {jobs.note}")
    if jobs.async_results:
        completed = [r for r in jobs.async_results if r.op.status == "completed"]
        waits = [r.latency_s for r in completed if r.latency_s is not None]
        charged = sum(r.op.charged_accelerator_ms for r in jobs.async_results)
        lines.append(
            f"  async      {len(jobs.async_results)} submitted (Submit, class "
            f"{jobs.async_results[0].op.request_class}), {len(completed)} completed, "
            f"{sum(r.op.status == 'failed' for r in jobs.async_results)} failed; submit to result "
            f"p50 {_seconds(waits, 50)}, p95 {_seconds(waits, 95)}; {charged:.1f} accelerator-ms charged"
        )
    else:
        lines.append("  async      none submitted (--async-jobs 0)")
    ours = [b for b in jobs.batches if not b.earlier]
    if not ours:
        lines.append("  batch      none submitted (--batch-items 0)")
    for b in jobs.batches:
        op, counts = b.op, b.op.counts
        head = "  earlier   " if b.earlier else "  batch     "
        text = (
            f"{head} {op.id} {op.status}: {counts.completed}/{counts.total} completed, {counts.failed} failed"
        )
        if b.items:
            # An item's attempts count the ones that failed or were lost (a kill mid-run) before it.
            retried = sum(item.attempts > 0 for item in b.items)
            text += (
                f"; {'one answer per item' if b.exactly_once else 'NOT one answer per item'} "
                f"({len({i.custom_id for i in b.items})} distinct custom ids in {len(b.items)} output lines, "
                f"{retried} after a failed or lost attempt)"
            )
        rate = (counts.completed + counts.failed) / b.elapsed_s if b.elapsed_s > 0 else 0.0
        text += f"; {b.elapsed_s:.1f} s here ({rate:.1f} items/s)"
        text += f"; {op.charged_accelerator_ms:.1f} accelerator-ms charged"
        if b.earlier:
            text += " (left unfinished by an earlier gateway, resumed)"
        lines.append(text)
    lines.append(f"  job store  {jobs.store}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- running


async def wait_ready(address: str, models: Sequence[str], key: str, timeout_s: float) -> None:
    """Until the gateway reports ready and every demo model is ready through it."""
    client = aioclient.InferenceServerClient(address)
    deadline = time.monotonic() + timeout_s
    last = "not ready"
    try:
        while time.monotonic() < deadline:
            try:
                if await client.is_server_ready():
                    missing = [m for m in models if not await client.is_model_ready(m, headers=bearer(key))]
                    if not missing:
                        return
                    last = f"models not ready: {', '.join(missing)}"
            except InferenceServerException as error:
                last = f"{status_name(error.status())}: {error.message()}"
            await asyncio.sleep(0.2)
    finally:
        await client.close()
    raise TimeoutError(f"gateway at {address} not ready after {timeout_s:.0f} s ({last})")


def triton_version(address: str) -> str:
    try:
        client = grpcclient.InferenceServerClient(address)
        try:
            version = str(client.get_server_metadata(client_timeout=5.0).version)
        finally:
            client.close()
    except Exception as error:
        return f"(version unavailable: {type(error).__name__})"
    return version


def demo_config(
    config: GatewayConfig, time_factor: float | None, state_dir: Path | None = None
) -> GatewayConfig:
    """The config with the demo's overrides: the emulator's time factor, the job state directory
    (``--state-dir``: SQLite there, enabling jobs when the config has no ``jobs:`` block)."""
    if state_dir is not None:
        jobs = config.jobs or JobsConfig(state_dir=state_dir)
        jobs = jobs.model_copy(update={"store": "sqlite", "state_dir": state_dir.resolve()})
        config = config.model_copy(update={"jobs": jobs})
    if time_factor is None:
        return config
    if config.local_triton is None:
        raise ConfigError("--time-factor", "", "the config has no local_triton to apply it to")
    local = config.local_triton.model_copy(update={"time_factor": time_factor})
    return config.model_copy(update={"local_triton": local})


def store_description(config: GatewayConfig) -> str:
    jobs = config.jobs
    if jobs is None:
        return "none"
    if jobs.store == "postgres":
        return "PostgreSQL (jobs.postgres_dsn)"
    return (
        f"SQLite in {jobs.state_dir} (a gateway killed mid-batch resumes the batch when one starts "
        "again on this directory)"
    )


async def run_demo(
    config: GatewayConfig,
    listen: str,
    settings: WorkloadSettings,
    ready_timeout_s: float,
    jobs_settings: JobsSettings | None = None,
    features: FeatureSettings | None = None,
) -> int:
    """Start Feast (unless ``features`` is None or says why not), the stack on ``config`` (its
    feature source pointed at that Feast), drive the modes at once, report, stop everything."""
    time_factor = config.local_triton.time_factor if config.local_triton is not None else 1.0
    scenarios = build_scenarios(time_factor)
    models = sorted({s.model for s in scenarios if s.expect == OK})
    jobs_result: JobsResult | None = None
    features_result: FeaturesResult | None = None
    feature_note = "not requested" if features is None else features.skip
    feast_failed = ""
    feast: FeastServer | None = None
    workdir: Path | None = None
    try:
        if features is not None and not feature_note:
            # Feast's work directory: a temporary one (the data is generated for this run's now).
            workdir = Path(tempfile.mkdtemp(prefix="orchid-demo-feast-"))
            print("starting a Feast feature server over examples/orchid/features ...", flush=True)
            began = time.monotonic()
            feast = FeastServer(workdir)
            try:
                await asyncio.to_thread(feast.start)
            except (FeastStartError, OSError) as error:
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(feast.stop)
                feast = None
                feast_failed = str(error).splitlines()[0] if str(error) else type(error).__name__
                feature_note = f"the Feast feature server failed to start: {feast_failed}"
                print(f"orchid-gateway demo: {feature_note}\n{error}", file=sys.stderr, flush=True)
            else:
                await asyncio.to_thread(warm_feast, feast.url)
                config = feature_config(config, feast.url, feast.registry_path, feast.repo_path)
                models = sorted({*models, FEATURE_MODEL})
                print(
                    f"feature store: Feast at {feast.url} (registry {feast.registry_path}; data generated "
                    f"for {feast.now.isoformat()}), ready in {time.monotonic() - began:.1f} s",
                    flush=True,
                )
        ran = await _run_stack(
            config,
            listen,
            settings,
            ready_timeout_s,
            jobs_settings,
            scenarios,
            models,
            time_factor,
            features if feast is not None else None,
            feast,
        )
        if isinstance(ran, int):
            return ran
        result, jobs_result, features_result = ran
    finally:
        if feast is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(feast.stop)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
    print("", flush=True)
    print(
        summarize_modes(
            result,
            jobs_result if config.jobs is not None else None,
            summarize_features(features_result, feature_note),
        ),
        flush=True,
    )
    print("", flush=True)
    print(summarize(result, settings), flush=True)
    code = 0
    if not any(o.admitted for o in result.outcomes):
        print("orchid-gateway demo: no request was admitted", file=sys.stderr)
        code = 1
    if feast_failed:
        print(f"orchid-gateway demo: the features mode did not run: {feature_note}", file=sys.stderr)
        code = 1
    if features_result is not None and not features_result.answered:
        print(f"orchid-gateway demo: no {FEATURE_MODEL} request was answered", file=sys.stderr)
        code = 1
    if jobs_result is not None and jobs_result.note:
        print(f"orchid-gateway demo: the jobs part was refused: {jobs_result.note}", file=sys.stderr)
        code = 1
    if jobs_result is not None and jobs_result.unfinished:
        print(
            f"orchid-gateway demo: not completed within {jobs_settings.timeout_s if jobs_settings else 0:g}"
            " s: "
            + ", ".join(jobs_result.unfinished)
            + f" (they stay in the job store: {store_description(config)})",
            file=sys.stderr,
        )
        code = 1
    if jobs_result is not None and not all(b.exactly_once for b in jobs_result.batches if b.items):
        print("orchid-gateway demo: a batch's output set is not one answer per item", file=sys.stderr)
        code = 1
    return code


async def _run_stack(
    config: GatewayConfig,
    listen: str,
    settings: WorkloadSettings,
    ready_timeout_s: float,
    jobs_settings: JobsSettings | None,
    scenarios: Sequence[Scenario],
    models: Sequence[str],
    time_factor: float,
    features: FeatureSettings | None,
    feast: FeastServer | None,
) -> int | tuple[WorkloadResult, JobsResult | None, FeaturesResult | None]:
    """Start the gateway (and its Triton and job store), drive the workload, stop it: the
    results, or the exit code when the stack could not start."""
    server = GatewayServer(config, listen=listen)
    jobs_result: JobsResult | None = None
    features_result: FeaturesResult | None = None
    try:
        try:
            await server.start()
            await wait_ready(server.address, models, DEMO_KEYS["orchid"], ready_timeout_s)
        except (TritonStartError, OSError, TimeoutError, grpc.RpcError) as error:
            hint = " (or pass --state-dir DIR)" if isinstance(error, StateDirectoryBusy) else ""
            print(f"orchid-gateway demo: the stack failed to start: {error}{hint}", file=sys.stderr)
            return 3
        if server.local_triton is not None:
            version = await asyncio.to_thread(triton_version, server.local_triton.address)
            backend = f"local Triton {version} at {server.local_triton.address} (time factor {time_factor:g})"
        else:
            backend = f"backends {', '.join(b.name + '=' + b.address for b in config.backends)}"
        print(f"orchid-gateway {__version__} demo: gateway on {server.address} -> {backend}", flush=True)
        print(f"job store: {store_description(config)}", flush=True)
        print(
            f"driving the demo workload for {settings.duration_s:g} s: online and streaming requests, "
            + (f"{FEATURE_MODEL} requests with upstream features, " if features is not None else "")
            + "async and batch jobs ...",
            flush=True,
        )
        jobs_run = None
        if config.jobs is not None and jobs_settings is not None:
            jobs_run = JobsRun(server.address, jobs_settings, store_description(config), sys.stdout)
        work: list[Any] = [drive(server.address, scenarios, settings, jobs_run.online if jobs_run else None)]
        if features is not None and feast is not None:
            features_result = FeaturesResult(f"Feast at {feast.url}")
            work.append(drive_features(server.address, features, settings.duration_s, features_result))
        if jobs_run is not None:
            work.append(jobs_run.run())
        try:
            done = await asyncio.gather(*work)
        finally:
            if jobs_run is not None:
                await jobs_run.client.close()
        result: WorkloadResult = done[0]
        if jobs_run is not None:
            jobs_result = done[-1]
    finally:
        with contextlib.suppress(Exception):
            await server.stop()
    return result, jobs_result, features_result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", type=Path, default=DEFAULT_CONFIG, help=f"gateway YAML (default: {DEFAULT_CONFIG})"
    )
    parser.add_argument("--duration", type=float, default=15.0, help="seconds of offered load (default 15)")
    parser.add_argument(
        "--time-factor",
        type=float,
        default=None,
        help="override local_triton.time_factor (the emulator's sleep multiplier)",
    )
    parser.add_argument("--rate", type=float, default=20.0, help="offered requests per second (default 20)")
    parser.add_argument("--workers", type=int, default=16, help="most requests in flight (default 16)")
    parser.add_argument("--seed", type=int, default=7, help="workload random seed (default 7)")
    parser.add_argument("--listen", default="127.0.0.1:0", help="gateway HOST:PORT (default: a free port)")
    parser.add_argument("--ready-timeout", type=float, default=60.0, help="seconds to wait for readiness")
    parser.add_argument("--log-level", default="WARNING", help="gateway log level (default WARNING)")
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="job store directory (SQLite; default: the config's jobs.state_dir, for the example "
        "examples/orchid/state/jobs)",
    )
    parser.add_argument(
        "--async-jobs", type=int, default=8, help="asynchronous requests to submit (default 8; 0: none)"
    )
    parser.add_argument(
        "--batch-items", type=int, default=200, help="lines of the demo batch (default 200; 0: no batch)"
    )
    parser.add_argument(
        "--jobs-timeout",
        type=float,
        default=120.0,
        help="seconds to wait for the async and batch work after submitting it (default 120)",
    )
    parser.add_argument(
        "--no-features",
        action="store_true",
        help="skip the features mode (no Feast feature server, no ranker requests): for machines "
        "without Feast (scripts/bootstrap.sh installs it); the report says it was skipped",
    )
    parser.add_argument(
        "--features-rate",
        type=float,
        default=FEATURES_RATE,
        help=f"offered ranker requests per second in the features mode (default {FEATURES_RATE:g})",
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.duration <= 0 or args.rate <= 0 or args.workers < 1:
        print("orchid-gateway demo: --duration and --rate must be > 0, --workers >= 1", file=sys.stderr)
        return 2
    if args.time_factor is not None and args.time_factor < 0:
        print("orchid-gateway demo: --time-factor must be >= 0", file=sys.stderr)
        return 2
    if args.features_rate <= 0:
        print("orchid-gateway demo: --features-rate must be > 0", file=sys.stderr)
        return 2
    if not 0 <= args.async_jobs <= MAX_ASYNC_JOBS or args.batch_items < 0 or args.jobs_timeout <= 0:
        print(
            f"orchid-gateway demo: --async-jobs must be 0..{MAX_ASYNC_JOBS}, --batch-items >= 0, "
            "--jobs-timeout > 0",
            file=sys.stderr,
        )
        return 2
    settings = WorkloadSettings(
        duration_s=args.duration, rate=args.rate, workers=args.workers, seed=args.seed
    )
    jobs_settings = JobsSettings(args.async_jobs, args.batch_items, args.jobs_timeout)
    try:
        config = demo_config(load_gateway_config(args.config), args.time_factor, args.state_dir)
    except ConfigError as error:
        print(f"orchid-gateway demo: invalid configuration: {error}", file=sys.stderr)
        return 2
    if config.jobs is not None and args.batch_items > config.jobs.max_batch_items:
        print(
            f"orchid-gateway demo: --batch-items {args.batch_items} is over the gateway's "
            f"jobs.max_batch_items ({config.jobs.max_batch_items})",
            file=sys.stderr,
        )
        return 2
    features = FeatureSettings(
        rate=args.features_rate, seed=args.seed, skip=features_skip_reason(config, args.no_features)
    )
    try:
        return asyncio.run(
            run_demo(config, args.listen, settings, args.ready_timeout, jobs_settings, features)
        )
    except ConfigError as error:  # cross-file checks happen at start
        print(f"orchid-gateway demo: invalid configuration: {error}", file=sys.stderr)
        return 2
