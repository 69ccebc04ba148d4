"""Decision log: whitelisted fields only, fail-open events always present."""

from __future__ import annotations

import io
import json
import logging
import textwrap
from pathlib import Path

import pytest

from gateway.policy import DecisionLog, compile_policies, load_policies
from gateway.policy.suites import build_inputs

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ROOT / "policies"

FIELDS = {
    "decision_id",
    "time",
    "request_id",
    "tenant",
    "class",
    "model",
    "model_version",
    "policy_version",
    "outcome",
    "status",
    "rule",
    "rules_fired",
    "shadow_fired",
    "fallback_eligible",
    "max_output_tokens",
    "eval_us",
    "fail_open",
    "errors",
    "fallback_refused",
}


def test_a_line_holds_exactly_the_whitelisted_fields() -> None:
    snapshot = load_policies(POLICIES)
    record, context = build_inputs({"shape": {"input_tokens": 4096}, "load": {"ladder_step": 2}})
    result = snapshot.evaluate(record, context)
    stream = io.StringIO()
    DecisionLog(stream).record(decision_id="d-1", at_unix_s=1_700_000_000.25, record=record, result=result)
    line = stream.getvalue()
    assert line.endswith("\n") and line.count("\n") == 1
    entry = json.loads(line)
    assert set(entry) == FIELDS
    assert entry["time"] == "2023-11-14T22:13:20.250Z"
    assert (entry["tenant"], entry["class"], entry["model"]) == ("orchid", "interactive", "full-v18")
    assert entry["policy_version"] == snapshot.version
    assert entry["shadow_fired"] == ["shadow-long-input-under-load"]
    assert entry["outcome"] == "allow" and entry["fail_open"] == []
    # nothing about the request's content or shape beyond identity
    for absent in ("input_tokens", "prompt", "payload", "tensor", "labels", "privacy_cell"):
        assert absent not in line


def test_fail_open_events_are_written_and_raise_the_log_level(caplog: pytest.LogCaptureFixture) -> None:
    snapshot = compile_policies(
        {
            "p.yaml": textwrap.dedent(
                """\
                rules:
                  - id: soft
                    stage: admission
                    on_error: allow
                    condition: 1 / (shape.items - 1) > 0
                    action: {deny: {status: RESOURCE_EXHAUSTED}}
                """
            )
        }
    )
    record, context = build_inputs({})
    result = snapshot.evaluate(record, context)
    logger = logging.getLogger("test.decisions")
    with caplog.at_level(logging.INFO, logger="test.decisions"):
        entry = DecisionLog(logger).record(
            decision_id="d-2", at_unix_s=0.0, record=record, result=result, outcome="admit"
        )
    assert entry is not None and entry.outcome == "admit"
    assert caplog.records[0].levelno == logging.WARNING
    logged = json.loads(caplog.records[0].getMessage())
    assert logged["fail_open"][0]["rule"] == "soft"
    assert logged["fail_open"][0]["error"]


def test_routine_decisions_are_not_built_for_a_silent_logger(caplog: pytest.LogCaptureFixture) -> None:
    snapshot = load_policies(POLICIES)
    record, context = build_inputs({})
    result = snapshot.evaluate(record, context)
    assert not result.fail_open
    logger = logging.getLogger("test.quiet-decisions")
    with caplog.at_level(logging.WARNING, logger="test.quiet-decisions"):
        entry = DecisionLog(logger).record(decision_id="d-3", at_unix_s=0.0, record=record, result=result)
    assert entry is None and not caplog.records
