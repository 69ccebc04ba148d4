"""Model entitlement is decided once (``gateway.core.entitlement``): the configured ``models``
list is the whole entitlement, an empty list entitles nothing, and the request path
(``Gateway.tenant_route``) and policy (``model-allowed`` reading ``tenant.entitled``) give the
same answer for every tenant and model, fallback candidates included."""

from __future__ import annotations

from typing import cast

import pytest

from gateway.auth import Tenant, TenantDirectory
from gateway.chain import judge
from gateway.config import TenantConfig, TenantsFile, load_gateway_config, load_routes, load_tenants
from gateway.core.entitlement import may_call
from gateway.core.errors import NotFound
from gateway.core.load import PoolLoad
from gateway.core.record import Budget, Demand, Identity, Mode, RequestRecord, Shape
from gateway.pipeline import Gateway
from gateway.policy import schema
from gateway.policy.loader import load_policies
from gateway.policy.store import PolicyStore
from gateway.policy.suites import build_inputs
from tests.conftest import EXAMPLE_CONFIG, ROOT

CONFIG = load_gateway_config(EXAMPLE_CONFIG)
ROUTES = load_routes(CONFIG.routes_dir)
POLICY = load_policies(ROOT / "policies")


def test_the_configured_list_is_the_whole_entitlement() -> None:
    assert may_call(("full-v18", "compact-v11"), "full-v18")
    assert not may_call(("full-v18",), "compact-v11")
    # Empty means none: never "every model the routes expose".
    assert not may_call((), "full-v18")
    assert not may_call((), "")


class _IdleLoad:
    """The two readings ``Judge.context`` takes from a pool's load."""

    def utilization(self) -> float:
        return 0.0

    def drain_ms(self) -> float:
        return 0.0


def _tenants(**models: tuple[str, ...]) -> TenantsFile:
    """The example tenants plus one tenant per keyword with that models list."""
    example = load_tenants(CONFIG.tenants_file)
    extra = {
        name: TenantConfig(
            client_cert_subjects=(f"{name}.example",),
            models=listed,
            classes=("interactive",),
            cells=("eu-restricted",),
        )
        for name, listed in models.items()
    }
    return example.model_copy(update={"tenants": {**example.tenants, **extra}})


def _record(tenant: str, model: str) -> RequestRecord:
    """A benign interactive request: only entitlement can refuse it."""
    return RequestRecord(
        identity=Identity(
            request_id="entitlement",
            tenant=tenant,
            request_class="interactive",
            model=model,
            model_version="1",
            operation="ModelInfer",
            mode=Mode.ONLINE,
            privacy_cell="eu-restricted",
        ),
        shape=Shape(items=1, input_tokens=16, max_output_tokens=16),
        demand=Demand(prefill_ms=0.5, decode_ms=0.5),
        budget=Budget(
            deadline_ms=1000.0,
            elapsed_ms=0.0,
            reserve_upstream_ms=0.0,
            reserve_exec_ms=1.0,
            reserve_fail_ms=0.0,
        ),
        ladder_step=0,
    )


def test_request_path_and_policy_agree_for_every_tenant_and_model() -> None:
    tenants = _tenants(nothing=(), only_compact=("compact-v11",))
    gateway = Gateway(CONFIG, TenantDirectory(tenants), ROUTES, {}, cast(PolicyStore, None))
    quota = gateway.quotas.available("orchid", "interactive", now=0.0)
    checked = 0
    for name, config in tenants.tenants.items():
        tenant = Tenant(name, config)
        for model, shared_route in ROUTES.models.items():
            try:
                gateway.tenant_route(tenant, model)
                served = True
            except NotFound:
                served = False
            assert served == tenant.may_call(model) == may_call(config.models, model), (name, model)
            # Policy judges the same model with the context the gateway builds for it: the
            # primary's context, as the fallback pass reuses it for the fallback candidate.
            route = shared_route.for_tenant(model, config) or shared_route
            context = gateway.chain.judge.context(
                tenant, route, config.home_cell, cast(PoolLoad, _IdleLoad()), quota
            )
            result = POLICY.evaluate(_record(name, model), context)
            assert (result.rule == "model-allowed") == (not served), (name, model, result.rule)
            assert result.allowed == served, (name, model, result.rule, result.message)
            checked += 1
    assert checked == len(tenants.tenants) * len(ROUTES.models)


@pytest.mark.parametrize(
    ("allowed_models", "model", "entitled"),
    [
        ([], "full-v18", False),  # empty: none
        (["full-v18"], "full-v18", True),
        (["full-v18"], "compact-v11", False),  # lumen's fallback candidate
    ],
)
def test_policy_reads_the_entitlement_as_a_fact(
    allowed_models: list[str], model: str, entitled: bool
) -> None:
    record, context = build_inputs(
        {"tenant": {"allowed_models": allowed_models}, "request": {"model": model}}
    )
    result = POLICY.evaluate(record, context)
    assert schema.flat_inputs(record, context)["tenant.entitled"] is entitled
    assert (result.rule == "model-allowed") is (not entitled)
    # The rule reads the gateway's answer; it does not re-derive it from the list.
    rule = next(r for r in POLICY.rules if r.id == "model-allowed")
    assert rule.condition_reads == ("tenant.entitled",)


def test_route_facts_follow_the_route_object() -> None:
    """What ``Judge.context`` derives from configuration is kept per route object and cell:
    another object for the same model (a rollout's candidate, a dedicated tenant's copy) gets
    its own, and the cache stays bounded."""
    gateway = Gateway(
        CONFIG, TenantDirectory(load_tenants(CONFIG.tenants_file)), ROUTES, {}, cast(PolicyStore, None)
    )
    route = ROUTES.models["full-v18"]
    facts = gateway.chain.judge.route_facts(route, "eu-restricted")
    assert gateway.chain.judge.route_facts(route, "eu-restricted") is facts
    assert facts.fallback is ROUTES.models.get(route.fallback or "")
    candidate = route.model_copy(update={"backend_model": "full-v19", "fallback": None})
    other = gateway.chain.judge.route_facts(candidate, "eu-restricted")
    assert other.route is candidate and other.fallback is None
    assert all(b.model == "full-v19" for b in other.backends)
    for n in range(judge.MAX_ROUTE_FACTS + 5):
        gateway.chain.judge.route_facts(route.model_copy(update={"version": str(n)}), "eu-restricted")
    assert gateway.chain.judge.cached_route_facts() <= judge.MAX_ROUTE_FACTS
