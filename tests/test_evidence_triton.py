"""Live quality evidence, end to end against the real example Triton: with the pool's ladder
pinned at step 3 (fallback for eligible work), expired or below-floor evidence for the
fallback disables it on the very next request, with the reason in the decision and the
denial counted, and publishing good evidence through the admin RPC re-enables it; the
degraded answer names the evidence it rests on."""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

import grpc
import pytest
from prometheus_client import REGISTRY
from tritonclient.grpc import service_pb2_grpc

from orchid_tools import cli
from orchid_tools.evidence import list_evidence, publish_evidence
from tests.conftest import OPS_KEY, ORCHID_KEY, ThreadedGateway
from tests.test_ladder_effects import AUTH, outcomes, pin, request

DAY = 86400.0
POPULATION = "orchid-text-eval-2026q3"


def publish(running: ThreadedGateway, **fields: Any) -> Any:
    base: dict[str, Any] = {
        "model": "compact-v11",
        "population": POPULATION,
        "samples": 500,
        "owner": "eval-team",
    }
    return publish_evidence(running.address, OPS_KEY, **(base | fields))


def denied(status: str) -> float:
    value = REGISTRY.get_sample_value(
        "orchid_evidence_denied_degradation_total",
        {"model": "full-v18", "degradation": "fallback", "status": status},
    )
    return value or 0.0


def test_evidence_disables_and_reenables_the_fallback(
    pinned: ThreadedGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    core = pinned.server.gateway
    assert core is not None
    rules: list[tuple[str, ...]] = []
    original = core.listener.decided
    monkeypatch.setattr(
        core.listener, "decided", lambda r, d, p: (rules.append(p.rules_fired), original(r, d, p))
    )
    now = time.time()
    with grpc.insecure_channel(pinned.address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        stub.ModelInfer(request(), metadata=AUTH, timeout=10)  # creates the pool's load

        # The seeded (undated) evidence: 0.86 >= 0.84, the fallback serves part of the excess.
        pin(pinned, 3, 1.22)
        seen = outcomes(stub, 20, **{"orchid.max_output_tokens": 16})
        assert seen["ok:fallback"] > 0, seen

        # Evidence evaluated 10 days ago with a 1-day maximum age: expired on arrival.
        before = denied("expired")
        publish(pinned, score=0.90, evaluated_at=now - 10 * DAY, max_age_s=DAY)
        rules.clear()
        seen = outcomes(stub, 20, **{"orchid.max_output_tokens": 16})
        assert seen == Counter({"ok:none": 20}), seen
        assert all("fallback-evidence-expired" in fired for fired in rules), rules
        assert denied("expired") - before == 20

        # A newer evaluation, current, but below the floor: still no fallback.
        before = denied("below_floor")
        publish(pinned, score=0.80, evaluated_at=now - DAY, max_age_s=30 * DAY)
        rules.clear()
        seen = outcomes(stub, 20, **{"orchid.max_output_tokens": 16})
        assert seen == Counter({"ok:none": 20}), seen
        assert all("fallback-quality-floor" in fired for fired in rules), rules
        assert denied("below_floor") - before == 20

        # Good evidence, published through the CLI: the fallback is back on the next request.
        code = cli.main(
            [
                "evidence", "publish", "--address", pinned.address, "--key", OPS_KEY,
                "--model", "compact-v11", "--population", POPULATION, "--score", "0.87",
                "--samples", "800", "--owner", "eval-team", "--review-by",
                time.strftime("%Y-%m-%d", time.gmtime(now + 30 * DAY)),
            ]
        )  # fmt: skip
        assert code == 0
        fallback_replies = []
        for _ in range(20):
            reply = stub.ModelInfer(request(**{"orchid.max_output_tokens": 16}), metadata=AUTH, timeout=10)
            if reply.parameters["orchid.approximation"].string_param == "fallback":
                fallback_replies.append(reply)
        assert fallback_replies, "good evidence re-enables the fallback"
        provenance = fallback_replies[0].parameters
        assert provenance["orchid.evidence_population"].string_param == POPULATION
        assert provenance["orchid.evidence_owner"].string_param == "eval-team"
        year = time.strftime("%Y-", time.gmtime(now))
        assert provenance["orchid.evidence_at"].string_param.startswith(year)
        assert provenance["orchid.risk_class"].string_param == "standard"

    listing = list_evidence(pinned.address, OPS_KEY)
    statuses = {(r.route, r.degradation): r.status for r in listing.routes}
    assert statuses[("full-v18", "fallback")] == "valid"
    assert statuses[("full-v18", "reduced_output")] == "valid"
    compact = [e for e in listing.evidence if e.model == "compact-v11" and e.population == POPULATION]
    assert [(e.score, e.source) for e in compact] == [(pytest.approx(0.87), "published")]


def test_publishing_needs_an_admin_credential_and_valid_fields(pinned: ThreadedGateway) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        publish_evidence(
            pinned.address, ORCHID_KEY, model="compact-v11", population=POPULATION, score=0.9,
            samples=10, owner="x", max_age_s=DAY,
        )  # fmt: skip
    assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED
    for bad in ({"score": 1.5}, {"score": 0.9, "model": "no-such-model"}, {"score": 0.9, "max_age_s": 0.0}):
        with pytest.raises(grpc.RpcError) as invalid:
            publish(pinned, **({"max_age_s": DAY} | bad))
        assert invalid.value.code() is grpc.StatusCode.INVALID_ARGUMENT, bad


def test_evidence_list_cli_json(pinned: ThreadedGateway, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["evidence", "list", "--json", "--address", pinned.address, "--key", OPS_KEY]) == 0
    data = json.loads(capsys.readouterr().out)
    routes = {(r["route"], r["degradation"]) for r in data["routes"]}
    assert ("full-v18", "fallback") in routes
    assert all(e["owner"] is not None for e in data["evidence"])
