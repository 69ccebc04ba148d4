"""``orchid-gateway demo``: the report's arithmetic and grouping, and one real run end to end.

The unit tests need no server. The end-to-end test starts the real stack (local Triton from the
nvidia-pytriton wheel + the gateway with its job store, in-process) through the CLI with a
short duration, a scaled-down time factor and a small batch, and checks the report: the five
modes (online, streaming, features, async, batch) each with its line, the batch's progress bar
and one answer per item, something admitted, ranker requests answered with their features'
provenance and user 7's stale values refused by the contract (a real Feast feature server, when
Feast is installed), every deliberately bad request answered with the status a correct gateway
gives, a provenance sample per model. With ``--no-features`` the demo runs the rest and says the
features mode was skipped.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import random
import re
from pathlib import Path
from typing import Any

import grpc
import pytest
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from gateway._proto import jobs_pb2
from gateway.config import load_gateway_config
from gateway.core.jobs import JobLimits
from gateway.jobs.batch import parse_jsonl
from gateway.jobs.store import SqliteJobStore
from orchid_tools import cli, demo
from orchid_tools.demo import OK, FeatureOutcome, Outcome, Scenario, WorkloadResult, WorkloadSettings
from orchid_tools.featurestore import feast_executable
from orchid_tools.jobs import Progress

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
    assert (args.state_dir, args.async_jobs, args.batch_items, args.jobs_timeout) == (None, 8, 200, 120.0)
    assert (args.no_features, args.features_rate) == (False, demo.FEATURES_RATE)


def test_the_example_stack_serves_jobs_from_a_state_directory_beside_it() -> None:
    config = load_gateway_config(EXAMPLE_CONFIG)
    assert config.jobs is not None and config.jobs.store == "sqlite"
    assert config.jobs.state_dir == EXAMPLE_CONFIG.parent / "state" / "jobs"


def test_state_dir_override(tmp_path: Path) -> None:
    config = load_gateway_config(EXAMPLE_CONFIG)
    changed = demo.demo_config(config, None, tmp_path / "jobs")
    assert changed.jobs is not None and changed.jobs.state_dir == (tmp_path / "jobs").resolve()
    assert config.jobs is not None and config.jobs.state_dir != changed.jobs.state_dir
    # A config without jobs gets them with --state-dir.
    bare = config.model_copy(update={"jobs": None})
    enabled = demo.demo_config(bare, None, tmp_path / "s")
    assert enabled.jobs is not None and enabled.jobs.state_dir == (tmp_path / "s").resolve()


def test_a_held_state_directory_says_so_and_how_to_run_beside_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    holder = SqliteJobStore(tmp_path, JobLimits())  # as a gateway started by hand would
    try:
        assert cli.main(["demo", "--state-dir", str(tmp_path), "--duration", "1"]) == 3
    finally:
        holder.close()
    err = capsys.readouterr().err
    assert f"job state directory {tmp_path} is in use by another gateway" in err
    assert err.rstrip().endswith("(or pass --state-dir DIR)")


def test_cli_rejects_bad_job_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    for flags in (
        ["--async-jobs", "-1"],
        ["--async-jobs", "101"],
        ["--batch-items", "-2"],
        ["--jobs-timeout", "0"],
    ):
        assert cli.main(["demo", *flags]) == 2
        assert "--async-jobs must be 0..100" in capsys.readouterr().err
    assert cli.main(["demo", "--batch-items", "50001"]) == 2
    assert "over the gateway's jobs.max_batch_items (50000)" in capsys.readouterr().err


def test_the_demo_batch_is_valid_jsonl_for_the_gateway() -> None:
    data = demo.batch_jsonl(5, "t")
    parsed = parse_jsonl(data, model=demo.JOB_MODEL, max_items=10)
    assert [custom_id for custom_id, _ in parsed.items] == [f"t-{i}" for i in range(5)]
    first = json.loads(data.splitlines()[0])
    assert first["inputs"][0]["shape"] == [1, demo.JOB_INPUT_TOKENS]
    assert first["parameters"] == {"orchid.max_output_tokens": demo.JOB_OUTPUT_TOKENS}


def _op(op_id: str, kind: str, status: str, total: int, completed: int, charged: float = 0.0) -> Any:
    op = jobs_pb2.Operation(id=op_id, kind=kind, status=status, request_class="batch")
    op.counts.total, op.counts.completed = total, completed
    op.charged_accelerator_ms = charged
    return op


def _items(ids: list[str], attempts: int = 0) -> list[Any]:
    return [jobs_pb2.BatchItem(custom_id=i, status="succeeded", attempts=attempts) for i in ids]


def test_modes_summary_has_a_line_per_mode() -> None:
    stream = Scenario("stream", "orchid", "interactive", "full-v18-stream", 8, "stream", 1.0, batched=False)
    online = WorkloadResult(
        [
            Outcome(SHORT, OK, 0.020),
            Outcome(SHORT, "DEADLINE_EXCEEDED", 0.001),
            Outcome(stream, OK, 0.050, first_token_s=0.010, tokens=32),
        ],
        offered=3,
        elapsed_s=1.0,
        unfinished=0,
    )
    jobs = demo.JobsResult(
        "SQLite in /x",
        async_results=[
            demo.AsyncResult(_op("op-a", "async", "completed", 1, 1, 10.0), 0.5),
            demo.AsyncResult(_op("op-b", "async", "completed", 1, 1, 12.0), 1.5),
        ],
        batches=[
            demo.BatchResult(
                _op("op-old", "batch", "completed", 3, 3, 30.0),
                2.0,
                _items(["a", "b"]) + _items(["c"], 1),
                True,
            ),
            demo.BatchResult(_op("op-new", "batch", "completed", 2, 2, 20.0), 1.0, _items(["x", "y"])),
        ],
    )
    text = demo.summarize_modes(online, jobs)
    lines = text.splitlines()
    assert lines[0] == "four modes"
    assert lines[1].startswith("  online     2 requests") and "1 admitted" in lines[1]
    assert lines[2].startswith("  streaming  1 streams, 1 completed, 32 tokens")
    assert lines[3].startswith("  async      2 submitted") and "2 completed, 0 failed" in lines[3]
    assert "22.0 accelerator-ms charged" in lines[3]
    earlier = next(line for line in lines if "op-old" in line)
    assert earlier.startswith("  earlier") and "resumed" in earlier
    assert (
        "one answer per item (3 distinct custom ids in 3 output lines, 1 after a failed or lost attempt)"
        in earlier
    )
    batch = next(line for line in lines if "op-new" in line)
    assert batch.startswith("  batch") and "2/2 completed" in batch and "one answer per item" in batch
    assert jobs.unfinished == []
    # A duplicated custom id is not one answer per item, and says so.
    duplicated = demo.BatchResult(_op("op-d", "batch", "completed", 2, 2), 1.0, _items(["x", "x"]))
    assert not duplicated.exactly_once
    assert "NOT one answer per item" in demo.summarize_modes(
        online, demo.JobsResult("s", batches=[duplicated])
    )
    # Unfinished work is named; a gateway without jobs says why async and batch did not run.
    late = demo.JobsResult("s", async_results=[demo.AsyncResult(_op("op-l", "async", "queued", 1, 0), None)])
    assert late.unfinished == ["op-l (async: queued)"]
    assert "no `jobs:` block" in demo.summarize_modes(online, None)
    refused = demo.JobsResult("s", note="RESOURCE_EXHAUSTED: too many unfinished items")
    assert "  jobs       refused: RESOURCE_EXHAUSTED: too many unfinished items" in demo.summarize_modes(
        online, refused
    )


def test_progress_is_bounded_off_a_terminal_and_redrawn_on_one() -> None:
    log = io.StringIO()
    progress = Progress(log, label="batch ", tty=False)
    for done in range(101):
        progress.update("in_progress" if done < 100 else "completed", done, 100)
    progress.close()
    lines = log.getvalue().splitlines()
    assert len(lines) == 11  # a line at each tenth (0 to 90 %), and the end (a new status and tenth)
    assert lines[0].startswith("batch [") and "0/100" in lines[0]
    assert lines[-1].startswith("batch [" + "#" * 30 + "] 100/100") and lines[-1].endswith("completed")
    screen = io.StringIO()
    bar = Progress(screen, tty=True)
    for done in (1, 2, 3):
        bar.update("in_progress", done, 3)
    bar.close()
    assert screen.getvalue().count("\r") == 3 and screen.getvalue().endswith("\n")
    assert "3/3" in screen.getvalue()


@pytest.mark.triton
def test_demo_end_to_end(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    state = tmp_path / "state"
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
            "--state-dir",
            str(state),
            "--async-jobs",
            "3",
            "--batch-items",
            "40",
        ]
    )
    captured = capsys.readouterr()
    out = captured.out
    assert code == 0, out + captured.err
    assert "local Triton 2." in out
    assert f"job store: SQLite in {state.resolve()}" in out
    assert (state / "jobs.sqlite3").is_file()  # the demo created the store
    # The four modes, each with its line; the batch's progress while it ran, and its output set.
    modes = out[out.index("five modes") :].splitlines()
    assert modes[1].startswith("  online ") and modes[2].startswith("  streaming ")
    features = modes[3]
    assert features.startswith("  features   "), out
    if feast_executable().exists():
        # A real Feast server (in a temporary directory, stopped at the end): ranker requests
        # answered with their snapshot's provenance, user 7's 3-day-old values refused as stale.
        assert "feature store: Feast at http://127.0.0.1:" in out, out
        answered = re.search(r" (\d+) answered, ", features)
        stale = re.search(r"refused: (?:[^;]*, )?stale (\d+)", features)
        assert answered is not None and int(answered.group(1)) > 0, features
        assert stale is not None and int(stale.group(1)) >= 1, features
        assert "of them from the feature cache" in features and " p50 " in features, features
        assert re.search(r"orchid\.feature_snapshot v12@\d{4}-\d\d-\d\dT[\d:]+Z", features), features
        assert "NOTE" not in features, features
    else:
        assert features.startswith("  features   skipped: Feast is not installed"), features
    assert modes[4].startswith("  async      3 submitted") and "3 completed, 0 failed" in modes[4], out
    assert modes[5].startswith("  batch      op-") and "40/40 completed, 0 failed" in modes[5], out
    assert "one answer per item (40 distinct custom ids in 40 output lines" in modes[5], out
    bars = [line for line in out.splitlines() if line.startswith("batch [")]
    assert bars and bars[-1].startswith("batch [" + "#" * 30 + "] 40/40"), out
    assert bars[-1].split(" | ")[0].endswith("completed")
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


@pytest.mark.triton
def test_demo_without_features_runs_the_other_modes_and_says_so(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code = cli.main(
        [
            "demo",
            "--no-features",
            "--duration",
            "1",
            "--time-factor",
            "0.2",
            "--state-dir",
            str(tmp_path / "state"),
            "--async-jobs",
            "1",
            "--batch-items",
            "0",
        ]
    )
    captured = capsys.readouterr()
    out = captured.out
    assert code == 0, out + captured.err
    assert "Feast" not in out.split("five modes")[0], out  # no feature server was started
    modes = out[out.index("five modes") :].splitlines()
    assert modes[1].startswith("  online ") and modes[2].startswith("  streaming ")
    assert modes[3] == "  features   skipped: --no-features", out
    assert modes[4].startswith("  async      1 submitted") and "1 completed" in modes[4], out


def _ranker(user: int, status: str = OK, *, rule: str = "", latency_s: float = 0.01, **prov: str) -> Any:
    outcome = Outcome(demo.FEATURE_SCENARIO, status, latency_s, rule=rule, provenance=dict(prov))
    return FeatureOutcome(user, outcome)


def test_the_features_line_counts_answers_cache_refusals_and_shows_a_snapshot() -> None:
    snapshot = "v12@2026-01-01T11:00:00Z"

    def _answer(user: int, latency_s: float, cached: str) -> Any:
        prov = {"orchid.feature_snapshot": snapshot, "orchid.feature_cached": cached}
        return _ranker(user, latency_s=latency_s, **prov)

    result = demo.FeaturesResult(
        "Feast at http://127.0.0.1:1",
        outcomes=[
            _ranker(
                1, latency_s=0.010, **{"orchid.feature_snapshot": snapshot, "orchid.feature_cached": "false"}
            ),
            _ranker(
                1, latency_s=0.002, **{"orchid.feature_snapshot": snapshot, "orchid.feature_cached": "true"}
            ),
            _ranker(
                2, latency_s=0.030, **{"orchid.feature_snapshot": snapshot, "orchid.feature_cached": "false"}
            ),
            _ranker(
                3, latency_s=0.020, **{"orchid.feature_snapshot": snapshot, "orchid.feature_cached": "true"}
            ),
            _ranker(7, "FAILED_PRECONDITION", rule="features.stale"),
            _ranker(7, "FAILED_PRECONDITION", rule="features.stale"),
            _ranker(8, "FAILED_PRECONDITION", rule="features.missing"),
            _ranker(4, "UNAVAILABLE", rule="features.upstream_backpressure"),
        ],
        offered=8,
    )
    line = demo.summarize_features(result)
    assert line.startswith("  features   8 ranker requests over 6 users (tenant orchid, Feast at ")
    assert "4 answered, 50 % of them from the feature cache" in line  # 2 of the 4 answers
    assert "refused: stale 2, missing 1, upstream_backpressure 1" in line
    assert "p50 10.0 ms" in line  # nearest rank of 2, 10, 20, 30 ms
    assert f"provenance (user 1) orchid.feature_snapshot {snapshot}" in line
    assert "NOTE" not in line
    # Against the contract: user 7 answered, a fresh user refused as stale. A refusal for the
    # source's state says nothing about the contract.
    assert _ranker(7).against_contract and _ranker(1, "X", rule="features.stale").against_contract
    assert not _ranker(7, "UNAVAILABLE", rule="features.source_failed").against_contract
    assert not _ranker(8, "X", rule="features.missing").against_contract
    result.outcomes.append(_ranker(8))
    assert "NOTE 1 answered against the contract" in demo.summarize_features(result)
    # Nothing answered, nothing refused.
    empty = demo.summarize_features(demo.FeaturesResult("Feast at x"))
    assert "0 answered, - of them" in empty and "refused: none" in empty and "p50 - ms" in empty
    assert demo.summarize_features(None, "--no-features") == "  features   skipped: --no-features"


def test_the_modes_summary_puts_the_features_line_after_streaming() -> None:
    online = WorkloadResult([Outcome(SHORT, OK, 0.020)], offered=1, elapsed_s=1.0, unfinished=0)
    lines = demo.summarize_modes(online, None, demo.summarize_features(None, "why")).splitlines()
    assert lines[0] == "five modes"
    assert lines[3] == "  features   skipped: why"
    assert lines[4].startswith("  async      not run")


def test_feature_users_are_mostly_fresh_with_a_few_stale_and_missing() -> None:
    settings = demo.FeatureSettings()
    rng = random.Random(1)
    users = [demo.feature_user(rng, settings) for _ in range(2000)]
    assert set(users) <= set(demo.FEATURE_USERS)
    stale, missing = users.count(demo.STALE_USER), users.count(demo.MISSING_USER)
    assert 0 < stale < 0.1 * len(users) and 0 < missing < 0.1 * len(users)
    assert len(set(users)) > 30  # many users, not a handful


def test_the_feature_source_is_pointed_at_the_demo_feast(tmp_path: Path) -> None:
    config = load_gateway_config(EXAMPLE_CONFIG)
    changed = demo.feature_config(config, "http://127.0.0.1:9", tmp_path / "registry.db")
    source = changed.feature_sources["feast"]
    assert source.url == "http://127.0.0.1:9" and source.registry == (tmp_path / "registry.db").resolve()
    assert source.timeout_ms == config.feature_sources["feast"].timeout_ms  # the rest as configured
    original = config.feature_sources["feast"]
    assert original.url == "http://127.0.0.1:6566"
    assert original.registry == EXAMPLE_CONFIG.parent / "features" / "data" / "registry.db"


def test_why_the_features_mode_is_skipped(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = load_gateway_config(EXAMPLE_CONFIG)
    assert demo.features_skip_reason(config, True) == "--no-features"
    assert demo.features_skip_reason(config.model_copy(update={"feature_sources": {}}), False) == (
        "the config has no feature_sources.feast"
    )
    monkeypatch.setattr(demo, "feast_executable", lambda: tmp_path / "feast")
    reason = demo.features_skip_reason(config, False)
    assert (
        reason.startswith(f"Feast is not installed ({tmp_path / 'feast'} is missing")
        and "bootstrap" in reason
    )
    monkeypatch.setattr(demo, "feast_executable", lambda: Path(__file__))  # present
    assert demo.features_skip_reason(config, False) == ""


def test_cli_rejects_a_bad_features_rate(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--features-rate", "0"]) == 2
    assert "--features-rate must be > 0" in capsys.readouterr().err
