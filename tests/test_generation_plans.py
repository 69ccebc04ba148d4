"""Plans, not per-request recomputation (issue 31 item 2): what depends only on (tenant,
route, class, cell) and the gateway's generation (``gateway.pools.Generation``) is derived
once per generation, and every change to what it is derived from (a policy reload, an
evidence publication, a backend health flip, a rollout step) takes effect on the very next
request, never one later. A cache never serves another tenant's or cell's plan.

In process, on the example stack with ``MemoryBackend`` at time factor 0 (as
``bench/request_path.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from gateway import clock
from gateway.backends.memory import MemoryBackend, MemoryModel
from gateway.backends.triton import TritonBackend
from gateway.config import GatewayConfig, hash_api_key, load_gateway_config
from gateway.core.errors import Unavailable
from gateway.core.evidence import Evidence, EvidenceKey, EvidenceStatus
from gateway.core.load import PoolLoad
from gateway.core.rollout import Phase
from gateway.evidence import EvidenceStore
from gateway.exchange import BackendHandle, CallContext
from gateway.pipeline import Gateway
from gateway.policy.schema import PolicyContext
from gateway.pools import PoolRegistry
from gateway.rollouts import load_rollouts
from gateway.server import assemble_gateway, load_configuration, load_policies
from orchid_tools.harness import memory_example
from orchid_tools.simulate import minted_key

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "orchid" / "gateway.yaml"
POPULATION = "orchid-text-eval-2026q3"


def _config(policies: Path | None = None) -> GatewayConfig:
    config = load_gateway_config(CONFIG)
    return config if policies is None else config.model_copy(update={"policies_dir": policies})


async def _gateway(config: GatewayConfig, *, candidate: bool = False) -> tuple[Gateway, MemoryBackend]:
    """The example stack on one MemoryBackend; ``candidate``: with rollouts/full-v19.yaml's
    candidate model in its repository, not loaded (explicit model control)."""
    tenants, routes = load_configuration(config)
    keyed = {
        name: tenant.model_copy(update={"key_sha256": (hash_api_key(minted_key(name)),)})
        for name, tenant in tenants.tenants.items()
    }
    tenants = tenants.model_copy(update={"tenants": keyed})
    extra = []
    if candidate:
        assert config.local_triton is not None
        full = routes.profiles[routes.models["full-v18"].profile]
        extra.append(
            MemoryModel(name="full-v19", profile=full, instances=config.local_triton.devices, loaded=False)
        )
    backend, handle = memory_example(config, routes, extra=extra)
    gateway = await assemble_gateway(config, tenants, routes, {"local": handle}, load_policies(config))
    return gateway, backend


def _request(model: str = "full-v18") -> bytes:
    request = service_pb2.ModelInferRequest(model_name=model)
    request.inputs.add(name="INPUT_IDS", datatype="INT32", shape=[1, 16])
    request.raw_input_contents.append(np.arange(16, dtype=np.int32).tobytes())
    request.parameters["orchid.max_output_tokens"].int64_param = 1
    return request.SerializeToString()


async def _infer(gateway: Gateway, tenant: str = "orchid") -> service_pb2.ModelInferResponse:
    metadata: tuple[tuple[str, str | bytes], ...] = (("authorization", f"Bearer {minted_key(tenant)}"),)
    return await gateway.infer(
        _request(), CallContext(metadata=metadata, time_remaining_s=None, received_at=clock.now())
    )


class _Contexts:
    """Every policy context the gateway judges, in order (the store's ``evaluate`` wrapped)."""

    def __init__(self, gateway: Gateway) -> None:
        self.seen: list[PolicyContext] = []
        evaluate = gateway.policy.evaluate

        def recording(record: Any, context: PolicyContext, snapshot: Any = None) -> Any:
            self.seen.append(context)
            return evaluate(record, context, snapshot)

        gateway.policy.evaluate = recording  # type: ignore[method-assign]


@pytest.fixture
def policies(tmp_path: Path) -> Iterator[Path]:
    directory = tmp_path / "policies"
    shutil.copytree(ROOT / "policies", directory)
    yield directory


def test_a_policy_reload_takes_effect_on_the_next_request(policies: Path) -> None:
    async def scenario() -> None:
        gateway, _backend = await _gateway(_config(policies))
        first = await _infer(gateway)
        before = first.parameters["orchid.policy_version"].string_param
        generation = gateway.generation.value
        edited = sorted(policies.rglob("*.yaml"))[0]
        edited.write_text(edited.read_text() + "\n# edited: a new version\n")
        result = gateway.policy.reload()
        assert result.ok and result.version != result.previous_version
        assert gateway.generation.value == generation + 1
        nxt = await _infer(gateway)
        assert nxt.parameters["orchid.policy_version"].string_param == gateway.policy.version != before
        again = gateway.generation.value
        gateway.policy.reload()  # the same files: no new snapshot, no new generation
        assert gateway.generation.value == again

    asyncio.run(scenario())


def test_an_evidence_publication_takes_effect_on_the_next_request() -> None:
    async def scenario() -> None:
        gateway, _backend = await _gateway(_config())
        contexts = _Contexts(gateway)
        await _infer(gateway)
        await _infer(gateway)  # the plan is cached now
        assert contexts.seen[-1].route.quality.reduced_output_evidence == "valid"
        generation = gateway.generation.value
        now = clock.wall()
        gateway.evidence.publish(
            Evidence(
                key=EvidenceKey("full-v18", "1", POPULATION, 32),
                score=0.5,  # under the floor (0.84, the fallback's)
                sample_size=100,
                owner="eval",
                evaluated_at=now,
                max_age_s=3600.0,
            )
        )
        assert gateway.generation.value == generation + 1
        await _infer(gateway)
        quality = contexts.seen[-1].route.quality
        assert quality.reduced_output_evidence == "below_floor"
        assert quality.reduced_output_score == 0.5
        assert contexts.seen[-1].route.quality.fallback_evidence == "valid"  # untouched

    asyncio.run(scenario())


def test_evidence_verdicts_are_cached_until_the_earliest_expiry_and_no_later() -> None:
    _tenants, routes = load_configuration(_config())
    store = EvidenceStore(routes)
    route, fallback = routes.models["full-v18"], routes.models["compact-v11"]
    store.publish(
        Evidence(
            key=EvidenceKey("compact-v11", "1", POPULATION),
            score=0.9,
            sample_size=10,
            owner="eval",
            evaluated_at=1000.0,
            review_by=1500.0,
        )
    )
    first = store.route_evidence("full-v18", route, fallback, floor=0.84, now=1100.0)
    assert first.fallback.status is EvidenceStatus.VALID
    assert store.route_evidence("full-v18", route, fallback, floor=0.84, now=1499.0) is first  # cached
    expired = store.route_evidence("full-v18", route, fallback, floor=0.84, now=1500.0)
    assert expired.fallback.status is EvidenceStatus.EXPIRED  # at the review date, not one call later
    assert expired.reduced_output.status is EvidenceStatus.VALID  # the undated seed holds
    # A clock stepped back judges again rather than serving a verdict from its future.
    assert store.route_evidence("full-v18", route, fallback, floor=0.84, now=1200.0).fallback.valid
    # Another floor is another plan.
    assert store.route_evidence("full-v18", route, fallback, floor=0.95, now=1200.0).fallback.status is (
        EvidenceStatus.BELOW_FLOOR
    )


def test_a_health_flip_takes_effect_on_the_next_request() -> None:
    async def scenario() -> None:
        gateway, backend = await _gateway(_config())
        await _infer(gateway)
        await _infer(gateway)
        backend.set_healthy(False)
        with pytest.raises(Unavailable):
            await _infer(gateway)
        backend.set_healthy(True)
        reply = await _infer(gateway)
        assert reply.model_name
        generation = gateway.generation.value
        gateway.pools.health_changed("local")  # what a client reports on a flip
        assert gateway.generation.value == generation + 1
        assert gateway.generation.reasons["health:local"] == 1

    asyncio.run(scenario())


def test_a_rollout_step_takes_effect_on_the_next_request() -> None:
    """rollouts/full-v19.yaml started in process: each phase change is a new generation, and
    an operator's promotion serves the very next request from the candidate (v19)."""

    async def scenario() -> None:
        config = _config()
        gateway, _backend = await _gateway(config, candidate=True)
        tenants, routes = load_configuration(config)
        spec = load_rollouts(ROOT / "rollouts", config, tenants, routes)["full-v19"]
        judge, pools = gateway.chain.judge, gateway.pools
        tenant = gateway.tenants.tenants["orchid"]
        route = gateway.chain.resolve.tenant_route(tenant, "full-v18")
        cell = tenant.config.home_cell
        first = await _infer(gateway)
        assert first.parameters["orchid.model_version"].string_param == "1"
        facts, plan = judge.route_facts(route, cell), pools.candidates(route, cell)
        generation = gateway.generation.value
        run = gateway.rollouts.start(spec)
        assert gateway.generation.value == generation + 1  # started: loading
        for _ in range(10_000):  # yield to the rollout's task until it has loaded and warmed
            if run.rollout.phase not in (Phase.LOADING, Phase.WARMING):
                break
            await asyncio.sleep(0)
        assert run.rollout.phase in (Phase.SHADOW, Phase.CANARY)
        assert gateway.generation.reasons["rollout"] == 2  # its first step
        try:
            assert judge.route_facts(route, cell) is not facts  # derived anew in this generation
            assert pools.candidates(route, cell) is not plan
            gateway.rollouts.promote(spec.name)
            assert gateway.generation.reasons["rollout"] == 3
            promoted = await _infer(gateway)  # the very next request
            assert promoted.parameters["orchid.model_version"].string_param == "v19"
        finally:
            await gateway.rollouts.close()

    asyncio.run(scenario())


def _two_cells() -> PoolRegistry:
    config = _config()
    _tenants, routes = load_configuration(config)
    models = {"full-v18": MemoryModel(name="full-v18", profile=routes.profiles["full-v18"], instances=1)}

    def handle(name: str, cell: str) -> BackendHandle:
        return BackendHandle(MemoryBackend(name, models, time_factor=0.0), {"cell": cell}, 1, 1)

    backends = {"a1": handle("a1", "a"), "b1": handle("b1", "b"), "a2": handle("a2", "a")}
    return PoolRegistry(config, routes, backends)


def test_a_plan_is_never_served_to_another_cell() -> None:
    pools = _two_cells()
    route = pools.routes.models["full-v18"].model_copy(update={"backends": ("a1", "b1", "a2")})
    in_a, in_b = pools.candidates(route, "a"), pools.candidates(route, "b")
    assert [n for n, _h in in_a.handles] == ["a1", "a2"]
    assert [n for n, _h in in_b.handles] == ["b1"]
    assert pools.candidates(route, "a") is in_a  # cached per cell
    assert [n for n, _h in pools.candidates(route, "a", exclude=("a1",)).handles] == ["a2"]
    assert pools.candidates(route, "a") is in_a  # an exclusion is its own plan

    async def placed(cell: str) -> str:
        handle, _spec, _queue = await pools.place(route, cell, "full-v18")
        return handle.client.name

    assert asyncio.run(placed("b")) == "b1"
    assert asyncio.run(placed("a")) in ("a1", "a2")


def test_a_plan_is_never_served_to_another_tenant() -> None:
    async def scenario() -> None:
        gateway, _backend = await _gateway(_config())
        contexts = _Contexts(gateway)
        tenants = [n for n, t in gateway.tenants.tenants.items() if t.may_call("full-v18")]
        assert len(tenants) >= 2
        judged: set[str] = set()
        for name in tenants * 2:  # every tenant twice: the second pass from the cached plans
            seen = len(contexts.seen)
            with contextlib.suppress(Exception):  # refused before or by policy: judged or not
                await _infer(gateway, name)
            for context in contexts.seen[seen:]:
                judged.add(name)
                assert context.tenant.name == name
                config = gateway.tenants.tenants[name].config
                assert context.tenant.allowed_models == config.models
                assert context.tenant.allowed_cells == config.cells
                assert context.tenant.dedicated == config.dedicated
        assert len(judged) >= 2, judged

    asyncio.run(scenario())


def test_a_context_from_a_cached_plan_equals_one_built_afresh() -> None:
    async def scenario() -> None:
        gateway, _backend = await _gateway(_config())
        await _infer(gateway)
        judge = gateway.chain.judge
        tenant = gateway.tenants.tenants["orchid"]
        route = gateway.chain.resolve.tenant_route(tenant, "full-v18")
        cell = tenant.config.home_cell
        load = PoolLoad("x", devices=4, dwell_budget_ms=20.0, config=gateway.config.ladder)
        quota = None  # unmetered
        fallback = gateway.routes.models["compact-v11"]
        verdicts = gateway.evidence.route_evidence("full-v18", route, fallback, floor=0.84, now=clock.wall())
        cached = judge.context(tenant, route, cell, load, quota, evidence=verdicts)
        again = judge.context(tenant, route, cell, load, quota, evidence=verdicts)
        assert again.route is cached.route  # one plan
        judge._route_facts.clear()
        assert judge.context(tenant, route, cell, load, quota, evidence=verdicts) == cached

    asyncio.run(scenario())


def test_a_triton_health_flip_starts_a_new_generation() -> None:
    """A Triton client reports its flips to the pool registry (a probe that finds the server
    gone); health itself is read live by placement on every request."""

    async def scenario() -> None:
        with socket.socket() as held:  # a port nothing listens on while the probe runs
            held.bind(("127.0.0.1", 0))
            address = f"127.0.0.1:{held.getsockname()[1]}"
            client = TritonBackend("t", address, max_message_bytes=1 << 20)
            pools = PoolRegistry(
                _config(), _two_cells().routes, {"t": BackendHandle(client, {"cell": "a"}, 1, 1)}
            )
            try:
                client.healthy = True
                generation = pools.generation.value
                assert await client.probe() is False
                assert pools.generation.value == generation + 1
                assert pools.generation.reasons == {"health:t": 1}
                assert await client.probe() is False  # no flip: no new generation
                assert pools.generation.value == generation + 1
            finally:
                await client.close()

    asyncio.run(scenario())
