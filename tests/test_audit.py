"""``orchid-gateway audit isolation``: reachability, co-batching and findings on real config files.

The shipped example is audited as shipped; every other case copies the example's YAML
(gateway, tenants, routes, policies) into ``tmp_path``, edits it and audits the copy, so
each finding is shown on the smallest change that causes it. No Triton is started.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import hash_api_key
from gateway.pools import PoolRegistry
from orchid_tools import audit as audit_module
from orchid_tools.audit import Audit, Severity, ShareLevel, audit_isolation
from orchid_tools.cli import main
from tests.conftest import EXAMPLE_CONFIG, MODEL_REPOSITORY, ROOT

Edit = Callable[[dict[str, Any]], None]


def _codes(audit: Audit, severity: Severity | None = None) -> set[str]:
    return {f.code for f in audit.findings if severity is None or f.severity is severity}


def _tenant(audit: Audit, name: str) -> Any:
    return next(t for t in audit.tenants if t.name == name)


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# --------------------------------------------------------------------------- the shipped example


def test_example_reachability() -> None:
    audit = audit_isolation(EXAMPLE_CONFIG)
    assert [(b.name, b.cell, b.device_group, b.source) for b in audit.backends] == [
        ("local", "eu-restricted", "local-a", "local_triton")
    ]
    orchid = _tenant(audit, "orchid")
    assert [(r.model, r.backend_model, r.version, [h.backend for h in r.hops]) for r in orchid.reach] == [
        ("full-v18", "full-v18", "1", ["local"]),
        ("compact-v11", "compact-v11", "1", ["local"]),
        ("full-v18-stream", "full-v18-stream", "1", ["local"]),
        ("ranker", "ranker-v3", "1", ["local"]),
        ("full-v18-tp2", "full-v18-tp2", "1", ["local"]),
        ("chat", "chat-v1", "1", ["local"]),
    ]
    # chat goes by prefix affinity: orchid's cache entries are kept under its own scope.
    assert [(p.route, p.max_extra_wait_ms, p.scopes) for p in audit.prefix] == [
        ("chat", 20.0, {"orchid": ("orchid|eu-restricted|chat-v1@1",)})
    ]
    assert all(h.routed and h.cell == "eu-restricted" for r in orchid.reach for h in r.hops)
    fallback = orchid.reach[0].fallback
    assert fallback is not None and fallback.model == "compact-v11"
    assert [h.backend for h in fallback.hops] == ["local"]
    assert fallback.config_allows and fallback.policy_allows and fallback.classes == ("interactive",)

    lumen = _tenant(audit, "lumen")
    assert [r.model for r in lumen.reach] == ["full-v18"]
    lumen_fallback = lumen.reach[0].fallback
    assert lumen_fallback is not None
    # Configuration would allow it; model-allowed denies compact-v11 (not in lumen's models).
    assert lumen_fallback.config_allows and not lumen_fallback.policy_allows
    assert "model-allowed" in lumen_fallback.policy_reason


def test_example_matrix_everyone_shares_full_v18() -> None:
    audit = audit_isolation(EXAMPLE_CONFIG)
    names = ("orchid", "lumen", "ops")
    # The dedicated kestrel shares the Triton server with everyone, never an instance.
    assert audit.matrix == {
        **{a: {**{b: "instance" for b in names if b != a}, "kestrel": "backend"} for a in names},
        "kestrel": dict.fromkeys(names, "backend"),
    }
    shared = {f"{i.backend}/{i.backend_model}": {a.tenant for a in i.access} for i in audit.instances}
    assert shared["local/full-v18"] == {"orchid", "lumen", "ops"}
    assert shared["local/full-v18-kestrel"] == {"kestrel"}
    assert shared["local/full-v18-stream"] == {"orchid", "ops"}
    compact = next(i for i in audit.instances if i.backend_model == "compact-v11")
    lumen_access = next(a for a in compact.access if a.tenant == "lumen")
    assert lumen_access.latent and not (lumen_access.direct_active or lumen_access.fallback_active)
    lumen_orchid = next(s for s in _tenant(audit, "lumen").shares if s.tenant == "orchid")
    assert {(i.instance, i.level) for i in lumen_orchid.instances} == {
        ("local/full-v18", ShareLevel.INSTANCE),
        ("local/compact-v11", ShareLevel.LATENT),
        ("local/full-v19", ShareLevel.FALLBACK),  # both are mirrored to the candidate (shadow)
    }
    assert shared["local/full-v19"] == {"orchid", "lumen", "ops"}  # never the dedicated kestrel


def test_example_findings_and_rules() -> None:
    audit = audit_isolation(EXAMPLE_CONFIG)
    assert audit.exit_code == 0
    assert _codes(audit, Severity.SEVERE) == set()
    # The dedicated tenant's own instances sit on the shared Triton server: said, not severe.
    # ... and the shipped route files seed undated, ownerless evidence that never expires.
    assert _codes(audit, Severity.WARN) == {"dedicated-shares-backend", "seeded-evidence-undated"}
    assert _codes(audit, Severity.INFO) == {"admin-tenant", "demo-keys", "fallback-policy-gated"}
    admin = next(f for f in audit.findings if f.code == "admin-tenant")
    assert "ops" in admin.message and "orchid" not in admin.message
    orchid = _tenant(audit, "orchid")
    assert orchid.demo_key
    assert [r.id for r in orchid.rules["privacy"]] == ["privacy-cell-allowed"]
    assert [r.id for r in orchid.rules["routing"]] == ["privacy-backend-cell"]
    assert all(r.scope == "global" for refs in orchid.rules.values() for r in refs)
    assert orchid.probes.cell_entitlement_enforced is True
    assert orchid.probes.backend_cell_enforced is True
    assert "privacy-backend-cell" in orchid.probes.backend_cell


def test_cli_text_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(["audit", "isolation", "--config", str(EXAMPLE_CONFIG)], capsys)
    assert code == 0
    assert "Co-batching matrix" in out and "Tenant lumen" in out
    assert "0 severe" in out and out.rstrip().endswith("exit 0")
    code, out, _ = _run(["audit", "isolation", "--config", str(EXAMPLE_CONFIG), "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["summary"] == {"severe": 0, "warn": 6, "info": 3, "exit_code": 0}
    assert data["matrix"]["lumen"] == {"orchid": "instance", "kestrel": "backend", "ops": "instance"}
    assert [t["name"] for t in data["tenants"]] == ["orchid", "lumen", "kestrel", "ops"]


# --------------------------------------------------------------------------- edited copies


def _copy_example(
    tmp_path: Path,
    *,
    gateway: Edit | None = None,
    tenants: Edit | None = None,
    routes: Edit | None = None,
    policies: dict[str, Edit | None] | None = None,
    fresh_keys: bool = True,
    keep_kestrel: bool = False,
) -> Path:
    """Copy the example's YAML into tmp_path, apply the edits, return the gateway.yaml path.
    ``fresh_keys`` replaces the published demo keys (a copy outside examples/ with them is severe).
    ``policies`` maps a policy file name to an edit, or to None to delete the file."""
    shutil.copytree(
        ROOT / "policies", tmp_path / "policies", ignore=shutil.ignore_patterns("tests", "requests")
    )
    shutil.copytree(ROOT / "routes", tmp_path / "routes")
    config = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    config.update(tenants_file="tenants.yaml", routes_dir="routes", policies_dir="policies")
    config["local_triton"]["model_repository"] = str(MODEL_REPOSITORY)
    tenant_data = yaml.safe_load((EXAMPLE_CONFIG.parent / "tenants.yaml").read_text())
    if not keep_kestrel:  # the scenarios below are about the three shared-instance tenants
        del tenant_data["tenants"]["kestrel"]
    if fresh_keys:
        for name, tenant in tenant_data["tenants"].items():
            tenant["key_sha256"] = [hash_api_key(f"test-key-{name}")]
    route_path = tmp_path / "routes" / "orchid.yaml"
    route_data = yaml.safe_load(route_path.read_text())
    for edit, data in ((gateway, config), (tenants, tenant_data), (routes, route_data)):
        if edit is not None:
            edit(data)
    for name, policy_edit in (policies or {}).items():
        policy_path = tmp_path / "policies" / name
        if policy_edit is None:
            policy_path.unlink()
            continue
        policy_data = yaml.safe_load(policy_path.read_text())
        policy_edit(policy_data)
        policy_path.write_text(yaml.safe_dump(policy_data, sort_keys=False))
    (tmp_path / "tenants.yaml").write_text(yaml.safe_dump(tenant_data, sort_keys=False))
    route_path.write_text(yaml.safe_dump(route_data, sort_keys=False))
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _drop_rule(rule_id: str) -> Edit:
    def edit(data: dict[str, Any]) -> None:
        data["rules"] = [r for r in data["rules"] if r["id"] != rule_id]

    return edit


def test_copy_with_fresh_keys_is_clean(tmp_path: Path) -> None:
    audit = audit_isolation(_copy_example(tmp_path))
    assert audit.exit_code == 0
    assert "demo-keys" not in _codes(audit)


def test_demo_keys_outside_examples_are_severe(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _copy_example(tmp_path, fresh_keys=False)
    audit = audit_isolation(path)
    demo = next(f for f in audit.findings if f.code == "demo-keys")
    assert demo.severity is Severity.SEVERE and "orchid, lumen, ops" in demo.message
    code, out, _ = _run(["audit", "isolation", "--config", str(path)], capsys)
    assert code == 1 and "SEVERE demo-keys" in out


def test_dedicated_tenant_sharing_a_backend_model_is_severe(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def dedicated_lumen(data: dict[str, Any]) -> None:
        data["tenants"]["lumen"]["dedicated"] = True

    path = _copy_example(tmp_path, tenants=dedicated_lumen)
    audit = audit_isolation(path)
    severe = [f for f in audit.findings if f.severity is Severity.SEVERE]
    assert [(f.code, f.tenant) for f in severe] == [
        ("dedicated-shares-instance", "lumen"),
        ("dedicated-shares-instance", "lumen"),
    ]
    assert any("orchid" in f.message and "local/full-v18" in f.message for f in severe)
    code, _, _ = _run(["audit", "isolation", "--config", str(path)], capsys)
    assert code == 1


def _vault_behind_a_fallback(data: dict[str, Any]) -> None:
    """A dedicated tenant on compact-v11; orchid and ops reach compact-v11 only as full-v18's fallback."""
    data["tenants"]["vault"] = {
        "key_sha256": [hash_api_key("test-key-vault")],
        "models": ["compact-v11"],
        "classes": ["interactive"],
        "cells": ["eu-restricted"],
        "dedicated": True,
    }
    for name in ("orchid", "ops"):
        data["tenants"][name]["models"] = ["full-v18"]


def test_dedicated_tenant_behind_a_policy_gated_fallback_is_a_warning(tmp_path: Path) -> None:
    # The shipped policy's model-allowed denies compact-v11 to tenants without it: latent sharing.
    audit = audit_isolation(_copy_example(tmp_path, tenants=_vault_behind_a_fallback))
    assert audit.exit_code == 0
    assert audit.matrix["vault"] == {"orchid": "latent", "lumen": "latent", "ops": "latent"}
    latent = [f for f in audit.findings if f.code == "dedicated-shares-instance-latent"]
    assert {f.tenant for f in latent} == {"vault"} and len(latent) == 3


def test_dedicated_tenant_reachable_via_another_tenants_fallback_is_severe(tmp_path: Path) -> None:
    path = _copy_example(
        tmp_path,
        tenants=_vault_behind_a_fallback,
        policies={"20-admission.yaml": _drop_rule("model-allowed")},
    )
    audit = audit_isolation(path)
    assert audit.exit_code == 1
    assert audit.matrix["vault"]["orchid"] == "fallback"
    severe = [f for f in audit.findings if f.severity is Severity.SEVERE]
    assert {(f.code, f.tenant) for f in severe} == {("dedicated-shares-instance", "vault")}
    assert any("through a fallback path" in f.message for f in severe)
    # and the fallback now answers tenants with a model they may not call directly
    outside = {f.tenant for f in audit.findings if f.code == "fallback-outside-allow-list"}
    assert outside == {"orchid", "lumen", "ops"}


def test_missing_privacy_routing_rule_is_severe(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _copy_example(tmp_path, policies={"10-privacy.yaml": _drop_rule("privacy-backend-cell")})
    audit = audit_isolation(path)
    assert _codes(audit, Severity.SEVERE) == {"policy-no-backend-cell-rule"}
    assert all(t.probes.backend_cell_enforced is False for t in audit.tenants)
    code, out, _ = _run(["audit", "isolation", "--config", str(path)], capsys)
    assert code == 1 and "policy-no-backend-cell-rule" in out


def test_privacy_rules_are_probed_not_matched_by_name(tmp_path: Path) -> None:
    def shadow_and_rename(data: dict[str, Any]) -> None:
        for rule in data["rules"]:
            if rule["id"] == "privacy-backend-cell":
                rule["mode"] = "shadow"  # evaluated, never enforced: no protection
            if rule["id"] == "privacy-cell-allowed":
                rule["id"] = "cells-of-the-credential"  # same rule, another name: still protects

    audit = audit_isolation(_copy_example(tmp_path, policies={"10-privacy.yaml": shadow_and_rename}))
    assert _codes(audit, Severity.SEVERE) == {"policy-no-backend-cell-rule"}
    assert "cells-of-the-credential" in _tenant(audit, "orchid").probes.cell_entitlement


def test_missing_cell_entitlement_rule_is_severe(tmp_path: Path) -> None:
    path = _copy_example(tmp_path, policies={"10-privacy.yaml": _drop_rule("privacy-cell-allowed")})
    audit = audit_isolation(path)
    assert _codes(audit, Severity.SEVERE) == {"policy-no-cell-entitlement"}


def test_tenant_cell_without_backend_is_a_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def second_cell(data: dict[str, Any]) -> None:
        data["tenants"]["lumen"]["cells"] = ["eu-restricted", "us-open"]

    path = _copy_example(tmp_path, tenants=second_cell)
    audit = audit_isolation(path)
    warnings = [
        (f.code, f.tenant)
        for f in audit.findings
        if f.severity is Severity.WARN and f.code != "seeded-evidence-undated"
    ]
    assert warnings == [("cell-without-backend", "lumen")]
    code, out, _ = _run(["audit", "isolation", "--config", str(path)], capsys)
    assert code == 0 and "WARN   cell-without-backend  lumen" in out


def _us_cell(gateway: dict[str, Any]) -> None:
    gateway["backends"] = [
        {
            "name": "gpu-us",
            "address": "127.0.0.1:1",
            "labels": {"cell": "us-open", "device_group": "us-a"},
            "devices": 1,
        }
    ]


def test_cells_contain_reachability_and_fallback(tmp_path: Path) -> None:
    def us_tenant(data: dict[str, Any]) -> None:
        data["tenants"]["atlas"] = {
            "key_sha256": [hash_api_key("test-key-atlas")],
            "models": ["full-v18"],
            "classes": ["interactive"],
            "cells": ["us-open"],
        }

    def compact_only_local(data: dict[str, Any]) -> None:
        data["models"]["compact-v11"]["backends"] = ["local"]

    path = _copy_example(tmp_path, gateway=_us_cell, tenants=us_tenant, routes=compact_only_local)
    audit = audit_isolation(path)
    atlas = _tenant(audit, "atlas")
    assert [h.backend for h in atlas.reach[0].hops] == ["gpu-us"]
    fallback = atlas.reach[0].fallback
    assert fallback is not None and fallback.hops == () and fallback.outside_cell == ("local",)
    assert fallback.status.startswith("never")
    assert ("fallback-outside-cell", "atlas") in {(f.code, f.tenant) for f in audit.findings}
    assert audit.matrix["atlas"] == {"orchid": "-", "lumen": "-", "ops": "-"}
    # the other tenants never reach the us backend
    assert all(
        h.backend == "local" for t in audit.tenants if t.name != "atlas" for r in t.reach for h in r.hops
    )
    assert audit.exit_code == 0


def test_other_entitled_cells_are_latent(tmp_path: Path) -> None:
    def roaming_dedicated(data: dict[str, Any]) -> None:
        data["tenants"]["roamer"] = {
            "key_sha256": [hash_api_key("test-key-roamer")],
            "models": ["full-v18"],
            "classes": ["interactive"],
            "cells": ["us-open", "eu-restricted"],
            "default_cell": "us-open",
            "dedicated": True,
        }

    audit = audit_isolation(_copy_example(tmp_path, gateway=_us_cell, tenants=roaming_dedicated))
    roamer = _tenant(audit, "roamer")
    assert [(h.backend, h.routed) for h in roamer.reach[0].hops] == [("gpu-us", True), ("local", False)]
    assert audit.matrix["roamer"]["orchid"] == "latent"
    codes = {(f.code, f.severity) for f in audit.findings if f.tenant == "roamer"}
    assert ("dedicated-shares-instance-latent", Severity.WARN) in codes
    assert ("inert-cell-entitlement", Severity.INFO) in codes
    assert audit.exit_code == 0


def test_routing_that_leaves_the_cell_is_severe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The audit runs the gateway's own routing function; were it to ignore cells, the audit says so."""

    def every_backend(self: PoolRegistry, route: Any, cell: str, exclude: Any = ()) -> list[str]:
        return list(route.backends or tuple(self.backends))

    monkeypatch.setattr(PoolRegistry, "candidate_backends", every_backend)
    audit = audit_isolation(_copy_example(tmp_path, gateway=_us_cell))
    assert "routing-leaves-cell" in _codes(audit, Severity.SEVERE)
    assert audit.exit_code == 1


def test_admin_and_identity_specific_rules_are_listed(tmp_path: Path) -> None:
    def lumen_rule(data: dict[str, Any]) -> None:
        data["rules"].append(
            {
                "id": "lumen-no-batch",
                "stage": "admission",
                "condition": "tenant.name == 'lumen' && request.class == 'batch'",
                "action": {"deny": {"status": "PERMISSION_DENIED"}},
            }
        )

    audit = audit_isolation(_copy_example(tmp_path, policies={"20-admission.yaml": lumen_rule}))
    scopes = {t.name: {r.id: r.scope for r in t.rules["admission"]} for t in audit.tenants}
    assert scopes["lumen"]["lumen-no-batch"] == "names-tenant"
    assert scopes["orchid"]["lumen-no-batch"] == "tenant-specific"
    assert scopes["orchid"]["class-allowed"] == "global"
    assert audit_module.DEMO_KEY_DIGESTS  # the digests of the README's demo keys


# --------------------------------------------------------------------------- files that do not load


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda tmp: tmp / "missing.yaml", "cannot read"),
        (
            lambda tmp: _copy_example(
                tmp, tenants=lambda d: d["tenants"]["lumen"].update(models=["no-such-model"])
            ),
            "tenants.lumen.models: unknown model 'no-such-model'",
        ),
        (
            lambda tmp: _copy_example(tmp, gateway=lambda d: d.update(default_class="nope")),
            "default_class 'nope' is not one of classes",
        ),
        (
            lambda tmp: _copy_example(
                tmp, policies={"10-privacy.yaml": lambda d: d["rules"][0].update(condition="request.nope")}
            ),
            "10-privacy.yaml",
        ),
    ],
)
def test_bad_config_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make: Callable[[Path], Path], expected: str
) -> None:
    path = make(tmp_path)
    code, out, err = _run(["audit", "isolation", "--config", str(path)], capsys)
    assert code == 2
    assert out == ""
    assert expected in err


def test_usage_error_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["audit", "isolation"])
    assert exit_info.value.code == 2
    assert "--config" in capsys.readouterr().err


# --------------------------------------------------------------------------- evidence and risk classes


def _dated(**quality: Any) -> Edit:
    """Route edit: date and own every seeded evidence block, then apply ``quality`` to compact-v11's."""

    def edit(data: dict[str, Any]) -> None:
        models = data["models"]
        blocks = [models["full-v18"]["quality"], models["full-v18"]["reduced_output"]["quality"]]
        blocks.append(models["compact-v11"]["quality"])
        for block in blocks:
            block.update(owner="eval-team", evaluated_at="2026-06-01", max_age_days=3650)
        models["compact-v11"]["quality"].update(quality)

    return edit


def test_example_evidence_section(capsys: pytest.CaptureFixture[str]) -> None:
    audit = audit_isolation(EXAMPLE_CONFIG)
    assert [r.route for r in audit.evidence] == ["full-v18"]
    checks = {c.degradation: c for c in audit.evidence[0].checks}
    fallback, reduced = checks["fallback"], checks["reduced_output"]
    assert (fallback.model, fallback.status, fallback.score, fallback.floor) == (
        "compact-v11",
        "valid",
        0.86,
        0.84,
    )
    assert (reduced.model, reduced.output_cap, reduced.status, reduced.score) == (
        "full-v18",
        32,
        "valid",
        0.89,
    )
    assert (fallback.source, fallback.evaluated_at, fallback.expires_at, fallback.owner) == (
        "seeded",
        "",
        "",
        "",
    )
    undated = [f.message for f in audit.findings if f.code == "seeded-evidence-undated"]
    assert len(undated) == 3 and all("never expires" in m for m in undated)
    code, out, _ = _run(["audit", "isolation", "--config", str(EXAMPLE_CONFIG)], capsys)
    assert code == 0
    assert "Quality evidence (the route files' seeded evidence, judged at " in out
    assert "fallback        compact-v11 v1 on orchid-text-eval-2026q3: valid (score 0.86" in out


def test_dated_owned_evidence_has_no_finding(tmp_path: Path) -> None:
    audit = audit_isolation(_copy_example(tmp_path, routes=_dated()))
    assert not {
        "seeded-evidence-undated",
        "seeded-evidence-no-owner",
        "evidence-disables-degradation",
    } & _codes(audit)
    check = next(c for c in audit.evidence[0].checks if c.degradation == "fallback")
    assert (check.owner, check.evaluated_at) == ("eval-team", "2026-06-01T00:00:00Z")
    assert check.expires_at.startswith("2036-")


def test_ownerless_dated_evidence_is_info(tmp_path: Path) -> None:
    audit = audit_isolation(_copy_example(tmp_path, routes=_dated(owner="")))
    found = [(f.severity, f.code) for f in audit.findings if f.code.startswith("seeded-evidence")]
    assert found == [(Severity.INFO, "seeded-evidence-no-owner")]


def test_expired_evidence_closes_the_fallback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _copy_example(tmp_path, routes=_dated(evaluated_at="2025-01-01", max_age_days=30))
    audit = audit_isolation(config, now=datetime(2026, 6, 2, tzinfo=UTC).timestamp())
    check = next(c for c in audit.evidence[0].checks if c.degradation == "fallback")
    assert (check.status, check.expires_at) == ("expired", "2025-01-31T00:00:00Z")
    disabled = [f for f in audit.findings if f.code == "evidence-disables-degradation"]
    assert [(f.severity, f.message.split(",")[0]) for f in disabled] == [
        (Severity.WARN, "full-v18: fallback is disabled")
    ]
    orchid = _tenant(audit, "orchid")
    path = orchid.reach[0].fallback
    assert path is not None and not path.policy_allows
    assert "fallback-evidence-expired" in path.policy_reason
    degradation = orchid.degradable[0]
    assert degradation.fallback == () and degradation.reduced_output == ("standard",)
    # The same files, judged before the evidence expired: the fallback is open again.
    fresh = audit_isolation(config, now=datetime(2025, 1, 15, tzinfo=UTC).timestamp())
    assert _tenant(fresh, "orchid").degradable[0].fallback == ("standard",)
    code, out, _ = _run(["audit", "isolation", "--config", str(config), "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["evidence"][0]["checks"][0]["status"] == "expired"


def test_below_floor_reduced_output_evidence(tmp_path: Path) -> None:
    def edit(data: dict[str, Any]) -> None:
        _dated()(data)
        data["models"]["full-v18"]["reduced_output"]["quality"]["score"] = 0.5

    audit = audit_isolation(_copy_example(tmp_path, routes=edit))
    check = next(c for c in audit.evidence[0].checks if c.degradation == "reduced_output")
    assert (check.status, check.score) == ("below_floor", 0.5)
    assert any(
        f.code == "evidence-disables-degradation" and "reduced_output is disabled" in f.message
        for f in audit.findings
    )
    assert _tenant(audit, "orchid").degradable[0].reduced_output == ()
    assert _tenant(audit, "orchid").degradable[0].fallback == ("standard",)


def test_risk_classes_degraded_on_the_example(capsys: pytest.CaptureFixture[str]) -> None:
    audit = audit_isolation(EXAMPLE_CONFIG)
    orchid = _tenant(audit, "orchid")
    assert [d.model for d in orchid.degradable] == ["full-v18"]
    full = orchid.degradable[0]
    assert full.classes == ("standard", "out_of_distribution", "regulated", "safety_critical")
    assert full.fallback == ("standard",) and full.reduced_output == ("standard",)
    assert full.never == ("out_of_distribution", "regulated", "safety_critical")
    # lumen may not call compact-v11: the policy never answers it with the fallback.
    assert _tenant(audit, "lumen").degradable[0].fallback == ()
    code, out, _ = _run(["audit", "isolation", "--config", str(EXAMPLE_CONFIG)], capsys)
    assert code == 0
    assert "full-v18  fallback: standard; reduced output: standard; never: out_of_distribution," in out
    _, out, _ = _run(["audit", "isolation", "--config", str(EXAMPLE_CONFIG), "--json"], capsys)
    tenant = json.loads(out)["tenants"][0]
    assert tenant["degradable"][0]["never"] == ["out_of_distribution", "regulated", "safety_critical"]


def test_risk_class_minimum_and_a_policy_without_the_veto(tmp_path: Path) -> None:
    def tenants(data: dict[str, Any]) -> None:
        data["tenants"]["orchid"]["risk_class"] = "out_of_distribution"

    def policy(data: dict[str, Any]) -> None:
        data["rules"] = [r for r in data["rules"] if r["id"] != "fallback-prohibited-risk"]

    audit = audit_isolation(_copy_example(tmp_path, tenants=tenants, policies={"40-fallback.yaml": policy}))
    full = _tenant(audit, "orchid").degradable[0]
    assert full.minimum == "out_of_distribution"
    assert full.classes == ("out_of_distribution", "regulated", "safety_critical")
    # Without the veto every class can get the fallback; the reduced-output rule still excludes them.
    assert full.fallback == full.classes and full.reduced_output == ()
