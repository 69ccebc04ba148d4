"""``orchid-gateway serve``: assemble the gateway from its config and run it.

Owns process lifecycle: load and cross-check configuration (a bad file exits
2 naming file, key path and problem), start and supervise the embedded local
Triton when configured, open backend channels and their health probes, serve
``inference.GRPCInferenceService`` + ``grpc.health.v1`` + server reflection,
and shut down on SIGTERM/SIGINT: report NOT_SERVING, stop taking new calls,
drain in-flight work within ``limits.drain_timeout_s``, stop Triton, exit 0.

The assembly of a ``Gateway`` from configuration and connected backends
(``load_configuration``, ``load_policies``, ``assemble_gateway``) and its
background loops (``update_ladders_forever``, ``sample_statistics_forever``) are
module functions, so that ``orchid-gateway simulate`` builds and runs the same
runtime on in-memory backends in virtual time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TextIO

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateway import admin, clock
from gateway.auth import TenantDirectory
from gateway.backends.local import LocalTriton, TritonStartError, supervise
from gateway.backends.triton import TritonBackend
from gateway.config import (
    BackendConfig,
    GatewayConfig,
    LocalTritonConfig,
    RouteTable,
    TenantsFile,
    check_dedicated,
    check_memory,
    check_references,
    load_gateway_config,
    load_routes,
    load_tenants,
)
from gateway.core.errors import ConfigError
from gateway.exchange import BackendHandle, GatewayListener
from gateway.features import check_contracts
from gateway.jobs import service as jobs_service
from gateway.jobs.runner import JobRunner, limits_of
from gateway.jobs.store import JobStore, open_store
from gateway.pipeline import Gateway
from gateway.policy.decision_log import DecisionLog
from gateway.policy.diagnostics import PolicyLoadError
from gateway.policy.store import PolicyStore
from gateway.protocol import SERVICE, InferenceServicer, add_to_server
from gateway.rollout_fleet import FleetRollouts
from gateway.rollouts import load_rollouts
from gateway.state.base import QuotaStore
from gateway.state.device_leases import FleetSlots
from gateway.state.estimator_sync import EstimatorSync
from gateway.state.fleet_load import FleetLoad
from gateway.state.metrics import StateCollector
from gateway.state.redis_store import RedisFleet, RedisQuotaStore
from gateway.statusboard import StatusBoard
from gateway.statuspage import TelemetryListener
from gateway.telemetry import ListenerGroup, Telemetry

log = logging.getLogger("orchid.gateway")
# How long stop waits for the background loops (ladders, statistics, fleet exchanges, policy
# watch) to end after their cancellation: each ends at its next await.
TASK_STOP_TIMEOUT_S = 5.0

LOCAL_BACKEND = "local"
# How often every pool's ladder steps from fresh evidence, and how often the backends'
# statistics are sampled (Triton's queue/compute split for the charge).
LADDER_UPDATE_S = 0.1
# Fleet (state.backend redis): offered demand is exchanged 4x per ladder update, so the other
# replicas' samples reach a ladder at most ~50 ms late (a late sample reads as missing demand).
FLEET_LOAD_EXCHANGE_S = LADDER_UPDATE_S / 4
ESTIMATOR_MERGE_S = 1.0  # the fleet's estimator corrections are merged this often
STATISTICS_SAMPLE_S = 1.0


# Services a config enables (the block that does): when the block is absent, a call answers
# UNIMPLEMENTED naming the service and the block, instead of grpc's bare "Method not found!".
OPTIONAL_SERVICES: dict[str, str] = {jobs_service.SERVICE: "jobs"}
DOCS = "docs/operators.md"
_ENABLED_BY_DOCS = {"jobs": f"{DOCS}#jobs-asynchronous-and-batch-inference"}


def not_configured_message(service: str, block: str) -> str:
    """The status message of a call to an optional service this gateway does not serve."""
    return (
        f"{service} is not served by this gateway: its config has no `{block}:` block "
        f"(add one to enable it; see {_ENABLED_BY_DOCS.get(block, DOCS)})"
    )


class NotConfiguredServices(grpc.GenericRpcHandler):  # type: ignore[misc]  # grpc is untyped
    """Every method of the named services answers UNIMPLEMENTED with the service's message.

    One stream-stream handler serves all call kinds (the status ends any of them) and reads no
    request; the message is fixed per service (the caller's method name is not echoed)."""

    def __init__(self, services: dict[str, str]) -> None:
        self._handlers = {
            service: grpc.stream_stream_rpc_method_handler(
                self._refusal(not_configured_message(service, block))
            )
            for service, block in services.items()
        }

    @staticmethod
    def _refusal(message: str) -> Callable[[object, grpc.aio.ServicerContext], Awaitable[None]]:
        async def refuse(requests: object, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, message)

        return refuse

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = str(handler_call_details.method)  # "/package.Service/Method"
        return self._handlers.get(method[1:].rsplit("/", 1)[0]) if method.startswith("/") else None


def load_configuration(config: GatewayConfig) -> tuple[TenantsFile, RouteTable]:
    """The tenants and routes files ``config`` names, loaded and cross-checked."""
    tenants = load_tenants(config.tenants_file)
    routes = load_routes(config.routes_dir)
    check_references(config, tenants, routes)
    check_memory(config, routes)
    check_dedicated(config, tenants, routes)
    check_contracts(config, routes)
    return tenants, routes


def repository_key(env_name: str | None) -> str | None:
    """The key of Triton's restricted model-repository protocol, from the environment variable
    the config names (keys stay out of config files); ConfigError if it is named but unset."""
    if env_name is None:
        return None
    key = os.environ.get(env_name, "")
    if not key:
        raise ConfigError(env_name, "repository_key_env", f"environment variable {env_name} is not set")
    return key


def load_policies(config: GatewayConfig) -> PolicyStore:
    """The policy set of ``config.policies_dir``, compiled; ``PolicyLoadError`` if it is bad."""
    policy = PolicyStore(config.policies_dir, engine=config.policy_engine)
    result = policy.reload()
    if not result.ok:
        raise PolicyLoadError(result.diagnostics)
    return policy


async def assemble_gateway(
    config: GatewayConfig,
    tenants: TenantsFile,
    routes: RouteTable,
    backends: dict[str, BackendHandle],
    policy: PolicyStore,
    *,
    listener: GatewayListener | None = None,
    quotas: QuotaStore | None = None,
) -> Gateway:
    """A ``Gateway`` over connected backends: each watches the readiness of every backend
    model a route, a dedicated tenant or a shadow may use (fallback warmth from the start)."""
    reserved = {m for t in tenants.tenants.values() for m in t.dedicated_models.values()}
    reserved |= {r.shadow.backend_model for r in routes.models.values() if r.shadow is not None}
    watched = {r.backend_model for r in routes.models.values()} | reserved
    for handle in backends.values():
        handle.client.watched_models.update(watched)
        await handle.client.probe()
    return Gateway(
        config, TenantDirectory(tenants), routes, backends, policy, listener=listener, quotas=quotas
    )


async def update_ladders_forever(gateway: Gateway, interval_s: float = LADDER_UPDATE_S) -> None:
    while True:
        await asyncio.sleep(interval_s)
        gateway.update_ladders(clock.now())


async def sample_statistics_forever(gateway: Gateway, interval_s: float = STATISTICS_SAMPLE_S) -> None:
    while True:
        await asyncio.sleep(interval_s)
        await gateway.sample_statistics()


class GatewayServer:
    """A running gateway: backends, request path, gRPC server. ``start``/``stop`` are async."""

    def __init__(self, config: GatewayConfig, *, listen: str | None = None) -> None:
        self.config = config
        self.listen = listen or config.listen
        self.local_triton: LocalTriton | None = None
        self._workdir: tempfile.TemporaryDirectory[str] | None = None
        self.server: grpc.aio.Server | None = None
        self.gateway: Gateway | None = None
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        self.port = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._decision_file: TextIO | None = None
        self.status_board = StatusBoard()
        self.telemetry_listener: TelemetryListener | None = None
        self.fleet: RedisFleet | None = None  # state.backend redis: this replica in the fleet
        self.shared_quotas: RedisQuotaStore | None = None
        self.fleet_load: FleetLoad | None = None  # the fleet-wide ladder's evidence exchange
        self.estimator_sync: EstimatorSync | None = None
        self.jobs_store: JobStore | None = None
        self.jobs_runner: JobRunner | None = None

    def _decision_log(self) -> DecisionLog:
        path = self.config.telemetry.decision_log
        if path is None:
            return DecisionLog(logging.getLogger("orchid.decisions"))
        self._decision_file = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - closed in stop()
        return DecisionLog(self._decision_file)

    def backend_configs(self) -> list[BackendConfig]:
        backends = list(self.config.backends)
        local = self.config.local_triton
        if local is not None and self.local_triton is not None:
            backends.append(
                BackendConfig(
                    name=LOCAL_BACKEND,
                    address=self.local_triton.address,
                    labels=local.labels,
                    devices=local.devices,
                    max_inflight_per_device=local.max_inflight_per_device,
                    shared_devices=local.shared_devices,
                    # The emulator's devices run `time_factor` x the profile's milliseconds.
                    time_scale=local.time_factor if local.time_factor > 0 else 1e-3,
                    device_memory_gib=local.device_memory_gib,
                    runtime_reserve_gib=local.runtime_reserve_gib,
                    repository_key_env=local.repository_key_env,
                    topology=local.topology,
                )
            )
        return backends

    async def start(self) -> None:
        config = self.config
        tenants, routes = load_configuration(config)
        rollouts = load_rollouts(config.rollouts_dir, config, tenants, routes) if config.rollouts_dir else {}
        if config.jobs is not None:  # first: a state directory another gateway holds fails fast
            self.jobs_store = await asyncio.to_thread(open_store, config.jobs, limits_of(config.jobs))
        if config.local_triton is not None:
            local = config.local_triton
            self._workdir = tempfile.TemporaryDirectory(prefix="orchid-triton-")
            self.local_triton = LocalTriton(
                local.model_repository,
                Path(self._workdir.name),
                grpc_port=local.grpc_port,
                time_factor=local.time_factor,
                startup_timeout_s=local.startup_timeout_s,
                extra_args=local.triton_args(repository_key(local.repository_key_env)),
                env=_emulated_devices(local, Path(self._workdir.name)),
            )
            log.info(
                "starting local Triton on %s (time factor %s)", self.local_triton.address, local.time_factor
            )
            await asyncio.to_thread(self.local_triton.start)
        clients = {}
        for backend in self.backend_configs():
            client = TritonBackend(
                backend.name,
                backend.address,
                max_message_bytes=config.limits.max_message_bytes,
                repository_key=repository_key(backend.repository_key_env),
            )
            await client.probe()
            client.start_probing()
            clients[backend.name] = BackendHandle(
                client,
                backend.labels,
                backend.devices,
                backend.max_inflight_per_device,
                backend.time_scale,
                backend.shared_devices,
                backend.memory,
                backend.topology,
            )
        self.policy = await asyncio.to_thread(load_policies, config)
        self.telemetry = Telemetry(config.telemetry, decision_log=self._decision_log())
        if config.state.backend == "redis":  # quotas and membership shared by the fleet
            self.fleet = RedisFleet(config.state)
            await self.fleet.start()
            self.shared_quotas = RedisQuotaStore(tenants.quotas, self.fleet)
            self.shared_quotas.watch_unmetered(tuple(tenants.tenants))
            self.telemetry.metrics.registry.register(StateCollector(self.fleet))
        self.gateway = await assemble_gateway(
            config,
            tenants,
            routes,
            clients,
            self.policy,
            listener=ListenerGroup(self.telemetry, self.status_board),
            quotas=self.shared_quotas,
        )
        if self.fleet is not None:  # N replicas never bind more than a pool's slots at once
            self.gateway.fleet_slots = FleetSlots(self.fleet)
        self.gateway.rollouts.specs.update(rollouts)
        # Rollouts a previous process left running continue (config rollouts_state_dir).
        self.gateway.rollouts.state_dir = config.rollouts_state_dir
        if self.fleet is not None:  # a fleet: one replica owns each rollout, the others follow
            self.gateway.rollouts.fleet = FleetRollouts(self.gateway.rollouts, self.fleet)
        self.gateway.rollouts.resume()
        if self.gateway.rollouts.fleet is not None:
            self.gateway.rollouts.fleet.start()
        self.telemetry.bind(self.gateway)
        self.status_board.bind(self.gateway)
        if config.telemetry.metrics_listen:
            self.telemetry_listener = TelemetryListener(
                self.telemetry.metrics.registry,
                self.gateway.tenants,
                self.status_board if config.telemetry.status_page else None,
                listen=config.telemetry.metrics_listen,
            )
            await self.telemetry_listener.start()
        limit = config.limits.max_message_bytes
        self.server = grpc.aio.server(
            options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
        )
        add_to_server(InferenceServicer(self.gateway, ready=self.ready), self.server)
        admin.add_to_server(self.gateway, self.server)
        services = [SERVICE, admin.SERVICE]
        if self.jobs_store is not None:  # async/batch jobs: durable store, trough runner, service
            assert config.jobs is not None
            self.jobs_runner = JobRunner(self.gateway, self.jobs_store, config.jobs)
            jobs_service.add_to_server(
                jobs_service.OperationsServicer(self.gateway, self.jobs_store, self.jobs_runner, config.jobs),
                self.server,
            )
            services.append(jobs_service.SERVICE)
        unserved = {name: block for name, block in OPTIONAL_SERVICES.items() if name not in services}
        if unserved:
            self.server.add_generic_rpc_handlers((NotConfiguredServices(unserved),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (
                *services,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            self.server,
        )
        self.port = self._listen(self.server)
        if self.port == 0:
            raise OSError(f"cannot listen on {self.listen}")
        await self.server.start()
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(sample_statistics_forever(self.gateway), name="stats"))
        self._tasks.append(loop.create_task(update_ladders_forever(self.gateway), name="ladders"))
        if self.fleet is not None:  # the ladders decide on the fleet's offered demand
            self.fleet_load = FleetLoad(self.gateway, self.fleet)
            exchange = self.fleet_load.run(FLEET_LOAD_EXCHANGE_S)
            self._tasks.append(loop.create_task(exchange, name="fleet-load"))
            self.estimator_sync = EstimatorSync(self.gateway.estimator, self.fleet)  # shared learning
            learning = self.estimator_sync.run(ESTIMATOR_MERGE_S)
            self._tasks.append(loop.create_task(learning, name="estimator-sync"))
        self._tasks.append(loop.create_task(self.policy.watch(config.policy_watch_s), name="policy-watch"))
        if self.local_triton is not None:  # the embedded server is started again after a crash
            self._tasks.append(loop.create_task(supervise(self.local_triton), name="local-triton"))
        if self.jobs_runner is not None:
            self.jobs_runner.start()
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("orchid-gateway listening on %s", self.address)

    def _listen(self, server: grpc.aio.Server) -> int:
        tls = self.config.tls
        if tls is None:
            return int(server.add_insecure_port(self.listen))
        credentials = grpc.ssl_server_credentials(
            [(tls.key_file.read_bytes(), tls.cert_file.read_bytes())],
            root_certificates=tls.client_ca_file.read_bytes() if tls.client_ca_file else None,
            # A client CA means mutual TLS: certificates are required *and verified*, so a
            # certificate's common name can be trusted as an identity (client_cert_subjects).
            require_client_auth=tls.client_ca_file is not None,
        )
        return int(server.add_secure_port(self.listen, credentials))

    @property
    def address(self) -> str:
        host = self.listen.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    def ready(self) -> bool:
        gateway = self.gateway
        return (
            gateway is not None
            and gateway.accepting
            and gateway.policy.ready
            and any(h.client.healthy for h in gateway.backends.values())
        )

    async def _set_health(self, status: int) -> None:
        for service in ("", SERVICE):
            result = self.health.set(service, status)
            if asyncio.iscoroutine(result):
                await result

    async def stop(self) -> None:
        """Drain: refuse new calls, let in-flight ones finish within the bound, then close."""
        if self.gateway is not None:
            self.gateway.accepting = False
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.server is not None:
            await self.server.stop(grace=self.config.limits.drain_timeout_s)
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            # Bounded: a background loop that lost its cancellation (a library turning it into
            # an ordinary error it then catches) must not hang the shutdown; it is named in the
            # log with where it was, and abandoned with the loop.
            _, stuck = await asyncio.wait(self._tasks, timeout=TASK_STOP_TIMEOUT_S)
            for task in stuck:
                where = "".join(
                    f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}; "
                    for frame in task.get_stack()
                )
                log.error(
                    "background task %s did not stop within %.0f s of its cancellation, abandoned (at %s)",
                    task.get_name(),
                    TASK_STOP_TIMEOUT_S,
                    where or "unknown",
                )
        if self.shared_quotas is not None:
            await self.shared_quotas.drain()  # the last settlements reach Redis (bounded)
        if self.fleet is not None:
            await self.fleet.stop()
        if self.jobs_runner is not None:
            await self.jobs_runner.stop()  # running items go back to the queue
        if self.jobs_store is not None:
            self.jobs_store.close()
        if self.gateway is not None:
            await self.gateway.rollouts.close()
            await self.gateway.features.close()
            for handle in self.gateway.backends.values():
                await handle.client.close()
        if self.local_triton is not None:
            await asyncio.to_thread(self.local_triton.stop)
        if self._workdir is not None:
            self._workdir.cleanup()
        if self.telemetry_listener is not None:
            await self.telemetry_listener.stop()
        if self._decision_file is not None:
            self._decision_file.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", required=True, type=Path, help="gateway YAML (see examples/orchid/gateway.yaml)"
    )
    parser.add_argument("--listen", help="HOST:PORT to listen on (overrides the config's listen)")
    parser.add_argument("--log-level", default="INFO")


async def _serve(server: GatewayServer) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
        print(f"orchid-gateway ready on {server.address}", flush=True)
        await stop.wait()
        log.info("shutting down: draining in-flight work (up to %ss)", server.config.limits.drain_timeout_s)
    finally:
        with contextlib.suppress(Exception):
            await server.stop()


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = load_gateway_config(args.config)
        server = GatewayServer(config, listen=args.listen)
        asyncio.run(_serve(server))
    except ConfigError as error:
        print(f"orchid-gateway: invalid configuration: {error}", file=sys.stderr)
        return 2
    except TritonStartError as error:
        print(f"orchid-gateway: local Triton failed to start: {error}", file=sys.stderr)
        return 3
    except OSError as error:
        print(f"orchid-gateway: {error}", file=sys.stderr)
        return 3
    return 0


def _emulated_devices(local: LocalTritonConfig, workdir: Path) -> dict[str, str]:
    """The capacity emulator's shared devices for a local Triton with a topology: every model's
    executions hold the devices the gateway names (``ORCHID_DEVICE_DIR``, one lock file per
    device); none without a topology (each instance stands for a device of its own)."""
    if local.topology is None:
        return {}
    directory = workdir / "devices"
    directory.mkdir(parents=True, exist_ok=True)
    return {"ORCHID_DEVICE_DIR": str(directory), "ORCHID_DEVICES": str(local.devices)}
