"""``PolicyContext`` is built by one function (``gateway.policy.context.build_policy_context``):
the request path, the isolation audit's probes and the policy test suites all go through it, so
they cannot disagree about a fact such as the quality floor."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest

from gateway.auth import Tenant, TenantDirectory
from gateway.config import RouteTable, load_gateway_config, load_routes, load_tenants
from gateway.core.load import PoolLoad
from gateway.pipeline import Gateway
from gateway.policy import context as builder
from gateway.policy.loader import load_policies
from gateway.policy.schema import LoadFacts, PolicyContext
from gateway.policy.store import PolicyStore
from gateway.policy.suites import BASE_GIVEN, build_inputs
from orchid_tools import audit
from tests.conftest import EXAMPLE_CONFIG, ROOT

CONFIG = load_gateway_config(EXAMPLE_CONFIG)
TENANTS = load_tenants(CONFIG.tenants_file)
EXAMPLE_ROUTES = load_routes(CONFIG.routes_dir)


def _routes() -> RouteTable:
    """full-v18 has no floor of its own and falls back to compact-v11 (floor 0.84); ``strict``
    declares its own floor (0.9) over the same fallback; ``bare`` has neither."""
    models = dict(EXAMPLE_ROUTES.models)
    full = models["full-v18"]
    assert full.quality_floor is None and models["compact-v11"].quality_floor == 0.84
    models["strict"] = full.model_copy(update={"quality_floor": 0.9})
    models["bare"] = full.model_copy(update={"fallback": None, "reduced_output": None})
    return EXAMPLE_ROUTES.model_copy(update={"models": models})


ROUTES = _routes()
EXPECTED_FLOOR = {"full-v18": 0.84, "strict": 0.9, "bare": builder.NO_EVIDENCE_FLOOR}


class _IdleLoad:
    def utilization(self) -> float:
        return 0.0

    def drain_ms(self) -> float:
        return 0.0


def _gateway_context(model: str) -> PolicyContext:
    gateway = Gateway(CONFIG, TenantDirectory(TENANTS), ROUTES, {}, cast(PolicyStore, None))
    tenant = Tenant("orchid", TENANTS.tenants["orchid"])
    quota = gateway.quotas.available("orchid", "interactive", now=0.0)
    return gateway.chain.judge.context(
        tenant, ROUTES.models[model], "eu-restricted", cast(PoolLoad, _IdleLoad()), quota
    )


def _audit_context(model: str) -> PolicyContext:
    served = audit.Served(EXAMPLE_CONFIG, CONFIG, TENANTS, ROUTES, load_policies(ROOT / "policies"))
    route = ROUTES.models[model]
    _, context = audit.probe_inputs(
        served,
        "orchid",
        TENANTS.tenants["orchid"],
        route,
        model=model,
        model_version=route.version,
        request_class="interactive",
        cell="eu-restricted",
    )
    return context


@pytest.mark.parametrize("model", sorted(EXPECTED_FLOOR))
def test_gateway_and_audit_derive_the_same_facts(model: str) -> None:
    served = _gateway_context(model)
    probed = _audit_context(model)
    assert served.route.quality.floor == probed.route.quality.floor == EXPECTED_FLOOR[model]
    # The same configuration gives the same facts; only what each observes differs (the
    # gateway sees no warm fallback here, the audit assumes one; the audit has no quota).
    assert served.route.quality == probed.route.quality
    assert dataclass_fields(served.tenant, skip={"accelerator_ms_per_s", "available_accelerator_ms"}) == (
        dataclass_fields(probed.tenant, skip={"accelerator_ms_per_s", "available_accelerator_ms"})
    )
    assert (served.route.model, served.route.fallback_model, served.route.reduced_output_tokens) == (
        probed.route.model,
        probed.route.fallback_model,
        probed.route.reduced_output_tokens,
    )


def dataclass_fields(value: Any, *, skip: set[str]) -> dict[str, Any]:
    return {name: getattr(value, name) for name in value.__slots__ if name not in skip}


def test_a_suite_reads_the_floor_the_gateway_derives() -> None:
    # BASE_GIVEN is the teaching request: orchid on full-v18 (no floor of its own) with the
    # compact-v11 fallback (floor 0.84). The gateway derives the same floor from that config.
    _, context = build_inputs({})
    assert context.route.quality.floor == BASE_GIVEN["route"]["quality"]["floor"]
    assert _gateway_context("full-v18").route.quality.floor == context.route.quality.floor


def _spy(monkeypatch: pytest.MonkeyPatch, module: Any) -> list[PolicyContext]:
    """Record every context ``module`` gets from the builder."""
    built: list[PolicyContext] = []
    real: Callable[..., PolicyContext] = builder.build_policy_context

    def recording(*args: Any, **kwargs: Any) -> PolicyContext:
        built.append(real(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(module, "build_policy_context", recording)
    return built


def test_all_three_callers_return_the_builders_context(monkeypatch: pytest.MonkeyPatch) -> None:
    import gateway.chain.judge
    import gateway.policy.suites

    for module, build in (
        (gateway.chain.judge, lambda: _gateway_context("full-v18")),
        (audit, lambda: _audit_context("full-v18")),
        (gateway.policy.suites, lambda: build_inputs({})[1]),
    ):
        built = _spy(monkeypatch, module)
        context = build()
        assert len(built) == 1 and context is built[0], module.__name__


def test_no_other_module_constructs_policy_facts() -> None:
    """The facts dataclasses are constructed in the builder only (and declared in the schema)."""
    facts = {"PolicyContext", "TenantFacts", "RouteFacts", "QualityEvidence"}
    allowed = {Path("gateway/policy/context.py"), Path("gateway/policy/schema.py")}
    offenders: list[str] = []
    for package in ("gateway", "orchid_tools"):
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT)
            if relative in allowed or "_proto" in relative.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Call):
                    name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                    if name in facts:
                        offenders.append(f"{relative}:{node.lineno}: {name}(...)")
    assert offenders == [], "build policy facts with gateway.policy.context.build_policy_context"


def test_the_builder_takes_the_routes_floor_then_its_fallbacks() -> None:
    full, compact = ROUTES.models["full-v18"], ROUTES.models["compact-v11"]
    assert builder.quality_floor(full, compact) == 0.84
    assert builder.quality_floor(ROUTES.models["strict"], compact) == 0.9
    assert builder.quality_floor(full, None) == builder.NO_EVIDENCE_FLOOR
    context = builder.build_policy_context(
        "orchid",
        TENANTS.tenants["orchid"],
        full,
        compact,
        fallback_warm=True,
        fallback_cell="eu-restricted",
        load=LoadFacts(),
        quota=None,
    )
    assert context.tenant.available_accelerator_ms == float("inf")
    assert context.tenant.allowed_models == TENANTS.tenants["orchid"].models
    assert context.route.reduced_output_tokens == 32 and context.route.quality.reduced_output_score == 0.89
