"""``orchid-gateway demo``: the report's arithmetic and grouping, and one real run end to end.

The unit tests need no server. The end-to-end test starts the real stack (local Triton from the
nvidia-pytriton wheel + the gateway, in-process) through the CLI with a short duration and a
scaled-down time factor, and checks the report: something admitted, every deliberately bad
request answered with the status a correct gateway gives, a provenance sample per model.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import grpc
import pytest
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from gateway.config import load_gateway_config
from orchid_tools import cli, demo
from orchid_tools.demo import OK, Outcome, Scenario, WorkloadResult, WorkloadSettings

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_CONFIG = ROOT / "examples" / "orchid" / "gateway.yaml"

SHORT = Scenario("short 256 tok", "orchid", "interactive", "full-v18", 256, "sync", 1.0)
BAD_MODEL = Scenario(
    "compact (not allowed)", "lumen", "interactive", "compact-v11", 256, "sync", 1.0, expect="NOT_FOUND"
)


class _FakeRpcError(grpc.RpcError):  # type: ignore[misc]
    def __init__(self, trailing: tuple[tuple[str, str], ...]) -> None:
        self._trailing = trailing

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailing


def _raised_like_tritonclient(trailing: tuple[tuple[str, str], ...], status: str, message: str) -> Exception:
    """tritonclient raises InferenceServerException inside `except grpc.RpcError` (so __context__ is set)."""
    try:
        try:
            raise _FakeRpcError(trailing)
        except grpc.RpcError:
            raise InferenceServerException(msg=message, status=status) from None
    except InferenceServerException as error:
        caught: Exception = error
        return caught
    raise AssertionError("unreachable")


def test_percentile_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert demo.percentile(values, 50) == 50.0
    assert demo.percentile(values, 95) == 95.0
    assert demo.percentile(values, 99) == 99.0
    assert demo.percentile([3.0], 99) == 3.0
    assert math.isnan(demo.percentile([], 50))


def test_status_name_strips_tritonclient_prefix() -> None:
    assert demo.status_name("StatusCode.NOT_FOUND") == "NOT_FOUND"
    assert demo.status_name("DEADLINE_EXCEEDED") == "DEADLINE_EXCEEDED"
    assert demo.status_name(None) == "UNKNOWN"


def test_error_outcome_reads_orchid_rule_from_the_rpc_error() -> None:
    error = _raised_like_tritonclient(
        (("orchid-rule", "admission.infeasible_deadline"), ("retry-after-ms", "40")),
        "StatusCode.DEADLINE_EXCEEDED",
        "predicted completion 441.0 ms ...",
    )
    outcome = demo.error_outcome(SHORT, error, 0.01)
    assert outcome.status == "DEADLINE_EXCEEDED"
    assert outcome.rule == "admission.infeasible_deadline"
    assert outcome.retry_after_ms == "40"
    assert not outcome.admitted
    assert demo.reason_of(outcome) == "rule admission.infeasible_deadline"


def test_error_outcome_without_trailing_metadata_groups_by_message() -> None:
    a = demo.error_outcome(
        BAD_MODEL, _raised_like_tritonclient((), "StatusCode.INVALID_ARGUMENT", "limit 512 exceeds 256"), 0.0
    )
    b = demo.error_outcome(
        BAD_MODEL, _raised_like_tritonclient((), "StatusCode.INVALID_ARGUMENT", "limit 600 exceeds 256"), 0.0
    )
    assert a.rule == ""
    assert demo.reason_of(a) == demo.reason_of(b) == "limit # exceeds #"
    # Numbers inside names are kept.
    c = demo.error_outcome(
        BAD_MODEL, _raised_like_tritonclient((), "StatusCode.NOT_FOUND", "unknown model 'compact-v11'"), 0.0
    )
    assert demo.reason_of(c) == "unknown model 'compact-v11'"


def test_stream_error_outcome_parses_status_prefix() -> None:
    error = InferenceServerException(msg="DEADLINE_EXCEEDED: predicted completion 389.5 ms ...")
    outcome = demo.stream_error_outcome(SHORT, error, 0.2)
    assert outcome.status == "DEADLINE_EXCEEDED"
    assert outcome.message.startswith("predicted completion")


def test_provenance_of_keeps_only_orchid_parameters() -> None:
    response = service_pb2.ModelInferResponse()
    response.parameters["orchid.model"].string_param = "full-v18"
    response.parameters["orchid.complete"].bool_param = True
    response.parameters["orchid.ladder_step"].int64_param = 0
    response.parameters["orchid.predicted_accelerator_ms"].double_param = 56.8
    response.parameters["triton_final_response"].bool_param = True
    assert demo.provenance_of(response) == {
        "orchid.complete": "true",
        "orchid.ladder_step": "0",
        "orchid.model": "full-v18",
        "orchid.predicted_accelerator_ms": "56.8",
    }


def test_scenarios_scale_deadlines_with_time_factor() -> None:
    for factor in (1.0, 0.2, 0.05):
        by_name = {s.name: s for s in demo.build_scenarios(factor)}
        predicted_s = demo.LONG_REQUEST_MS * factor / 1000.0
        tight = by_name["long, tight deadline"]
        ok = by_name["long 4096 tok"]
        assert tight.timeout_s is not None and tight.timeout_s < predicted_s
        assert ok.timeout_s is not None and ok.timeout_s > 2 * predicted_s
    scenarios = demo.build_scenarios(1.0)
    assert {s.expect for s in scenarios} == {
        OK,
        "NOT_FOUND",
        "DEADLINE_EXCEEDED",
        "UNAUTHENTICATED",
        "INVALID_ARGUMENT",
    }
    stream = next(s for s in scenarios if s.client == "stream")
    assert stream.model == "full-v18-stream" and not stream.batched
    assert demo.token_array(stream.tokens, stream.batched, 1).shape == (256,)
    assert demo.token_array(4096, True, 1).shape == (1, 4096)


def test_summary_groups_by_tenant_class_and_status() -> None:
    prov = {"orchid.model": "full-v18", "orchid.approximation": "fallback", "orchid.rules": ""}
    outcomes = [
        Outcome(SHORT, OK, 0.050, provenance=prov),
        Outcome(SHORT, OK, 0.070, provenance={**prov, "orchid.approximation": "none"}),
        Outcome(SHORT, "DEADLINE_EXCEEDED", 0.001, rule="admission.infeasible_deadline", message="too slow"),
        Outcome(BAD_MODEL, "NOT_FOUND", 0.001, message="unknown model 'compact-v11'"),
    ]
    settings = WorkloadSettings(duration_s=1.0, rate=10.0, workers=4, seed=1)
    text = demo.summarize(WorkloadResult(outcomes, offered=4, elapsed_s=1.0, unfinished=0), settings)
    assert "4 answered, 2 admitted" in text
    orchid_row = next(line for line in text.splitlines() if line.strip().startswith("orchid/interactive"))
    # sent, admitted, fallback, rejected, p50, p95, p99
    assert orchid_row.split()[2:] == ["3", "2", "1", "1", "50.0", "70.0", "70.0"]
    assert "rule admission.infeasible_deadline" in text
    assert "unknown model 'compact-v11'" in text
    assert "compact (not allowed)" in text  # the on-purpose column names the scenario
    assert "NOTE" not in text
    assert "orchid.rules" in text and "(empty)" in text


def test_summary_flags_bad_requests_answered_unexpectedly() -> None:
    outcomes = [Outcome(BAD_MODEL, "PERMISSION_DENIED", 0.001, message="nope")]
    settings = WorkloadSettings(duration_s=1.0, rate=10.0, workers=4, seed=1)
    text = demo.summarize(WorkloadResult(outcomes, offered=1, elapsed_s=1.0, unfinished=0), settings)
    assert "NOTE deliberately bad requests answered differently than expected" in text
    assert "(no admitted responses)" in text


def test_time_factor_override_uses_model_copy() -> None:
    config = load_gateway_config(EXAMPLE_CONFIG)
    changed = demo.demo_config(config, 0.25)
    assert changed.local_triton is not None and changed.local_triton.time_factor == 0.25
    assert config.local_triton is not None and config.local_triton.time_factor == 1.0
    assert demo.demo_config(config, None) is config


def test_cli_rejects_bad_arguments(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cli.main(["demo", "--duration", "0"]) == 2
    assert cli.main(["demo", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "invalid configuration" in capsys.readouterr().err


def _run_args(**overrides: Any) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args([])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_defaults() -> None:
    args = _run_args()
    assert args.config == demo.DEFAULT_CONFIG
    assert args.duration == 15.0
    assert args.time_factor is None
    assert args.listen == "127.0.0.1:0"


@pytest.mark.triton
def test_demo_end_to_end(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(
        [
            "demo",
            "--config",
            str(EXAMPLE_CONFIG),
            "--duration",
            "3",
            "--time-factor",
            "0.2",
            "--rate",
            "15",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "local Triton 2." in out
    assert "per tenant / class" in out
    # Every deliberately bad request got the status a correct gateway gives (the first arrivals
    # visit each scenario once, so each appears even in a short run).
    assert "NOTE deliberately bad" not in out, out
    for status in ("UNAUTHENTICATED", "NOT_FOUND", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED"):
        assert status in out, out
    assert "rule deadline-infeasible" in out, out
    for model in ("full-v18", "compact-v11", "full-v18-stream"):
        assert f"  {model} (" in out, out
    assert "orchid.request_id" in out


def test_a_capped_fallback_answer_counts_as_fallback() -> None:
    # orchid.approximation lists every degradation that applied.
    for listed, fallback in (("fallback,reduced_output", True), ("reduced_output", False), ("none", False)):
        outcome = Outcome(SHORT, OK, 0.05, provenance={"orchid.approximation": listed})
        assert outcome.fallback is fallback
