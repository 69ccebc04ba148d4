"""``orchid-gateway policy lint|test|explain`` through ``orchid_tools.cli.main``: output and exit codes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from orchid_tools.cli import main

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _in_repository_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the commands below use repository-relative paths, as an author would


def copy_policies(tmp_path: Path) -> Path:
    target = tmp_path / "policies"
    shutil.copytree(ROOT / "policies", target)
    return target


def test_lint_ok(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "lint", "policies"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "ok: 20 rules (1 shadow), 3 variables in 5 files; version orchid-default-2 (sha256:"
    )


def test_lint_invalid_policy_prints_location_line_and_caret(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policies = copy_policies(tmp_path)
    path = policies / "20-admission.yaml"
    text = path.read_text().replace("budget.slack_ms < 0.0", "budget.slack_ms < 0")
    path.write_text(text)
    line = text.splitlines().index("    condition: budget.slack_ms < 0") + 1
    assert main(["policy", "lint", str(policies)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{path}:{line}:32: found no matching overload for '_<_' applied to '(double, int)'"
    assert lines[1] == "        condition: budget.slack_ms < 0"
    assert lines[2] == "                                   ^"
    assert lines[-1] == f"1 problem in {policies} (engine cel-expr)"


def test_lint_single_file_and_engine_choice(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "lint", "policies/40-fallback.yaml", "--engine", "cel-python"]) == 0
    assert "engine cel-python" in capsys.readouterr().out


def test_lint_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "lint", "no/such/dir"]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["policy", "lint", "policies", "--engine", "cel-rust"])
    assert info.value.code == 2


def test_test_passes_and_reports_coverage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "test", "policies"]) == 0
    out = capsys.readouterr().out
    assert "PASS privacy: a cell the tenant is not entitled to is denied" in out
    assert "every rule is exercised by at least one test (20 rules)" in out
    assert "FAIL" not in out


def test_test_failure_exits_1_with_the_mismatch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policies = copy_policies(tmp_path)
    suite = policies / "tests" / "quota.yaml"
    suite.write_text(suite.read_text().replace("retry_after_ms: 37", "retry_after_ms: 40"))
    assert main(["policy", "test", str(policies)]) == 1
    out = capsys.readouterr().out
    assert "FAIL quota: a request beyond the balance is rejected with retry after the refill" in out
    assert "    retry_after_ms: expected 40, got 37" in out
    cases = sum(
        text.count("\n  - name: ") for text in (p.read_text() for p in (policies / "tests").glob("*.yaml"))
    )
    assert f"{cases - 1} passed, 1 failed" in out


def test_test_lists_rules_no_case_exercises(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policies = copy_policies(tmp_path)
    (policies / "tests" / "admission.yaml").unlink()
    assert main(["policy", "test", str(policies)]) == 0
    out = capsys.readouterr().out
    assert (
        "rules not exercised by any test (6): class-allowed, model-allowed, deadline-infeasible, "
        "deadline-behind-queue" in out
    )
    assert main(["policy", "test", str(policies), "--require-coverage"]) == 1


def test_test_invalid_suite_and_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policies = copy_policies(tmp_path)
    (policies / "tests" / "broken.yaml").write_text(
        "cases:\n  - name: x\n    given: {budget: {slack_ms: -1.0}}\n    expect: {outcome: deny}\n"
    )
    assert main(["policy", "test", str(policies)]) == 1
    out = capsys.readouterr().out
    assert "broken.yaml:3:22: budget.slack_ms is derived from" in out
    assert main(["policy", "test", str(tmp_path / "nothing")]) == 2


def test_explain_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "explain", "--request", "policies/requests/teaching-request.yaml"]) == 0
    out = capsys.readouterr().out
    assert "routing    privacy-backend-cell @triton-us-1  enforce  fired      exclude triton-us-1" in out
    assert 'reads request.privacy_cell="eu-restricted", tenant.allowed_cells=["eu-restricted"]' in out
    assert "decision: allow" in out
    assert "excluded backends: triton-us-1" in out


def test_explain_json_for_a_denied_request(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "policy",
        "explain",
        "--request",
        "policies/requests/late-request.json",
        "--policies",
        "policies",
        "--json",
    ]
    assert main(argv) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["decision"]["outcome"] == "deny"
    assert document["decision"]["rule"] == "deadline-infeasible"
    assert document["inputs"]["budget"]["slack_ms"] == -37.0
    assert document["policy"]["label"] == "orchid-default-2"
    deadline = next(r for r in document["rules"] if r["rule"] == "deadline-infeasible")
    assert deadline["result"] == "fired" and deadline["inputs"]["budget.slack_ms"] == -37.0
    assert all(r["result"] == "skipped" for r in document["rules"] if r["stage"] in ("fallback", "routing"))


def test_explain_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "explain", "--request", str(tmp_path / "missing.yaml")]) == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("request: {clas: interactive}\n")
    assert main(["policy", "explain", "--request", str(bad)]) == 2
    assert "bad.yaml:1:11: unknown field 'request.clas'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["policy", "explain"])
    assert info.value.code == 2
