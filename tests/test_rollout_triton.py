"""A version change rehearsed end to end against a real Triton, under a steady load.

This module runs its own Triton in explicit model-control mode (only full-v18 and
compact-v11 loaded at start) over a copy of the example repository with candidate versions
of full-v18 added: ``full-v19`` (the shipped candidate), ``full-v19-slow`` (the emulator's
time factor raised 100x for it), ``full-v19-badload`` and ``full-v19-oom`` (forced allocation
failures through the emulator's ``ORCHID_FAULT_DIR``: at load, and from the first execution
after the warm-up). Rollouts are started through the admin RPC (``orchid_tools.rollout``),
while three closed-loop clients keep sending: tenant orchid short (the canary cohort), tenant
lumen short and tenant orchid long (never in the cohort). Every test waits for the rollout's
own task to end (retirement included) and then checks what the clients saw.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import redis.asyncio as aioredis
import tritonclient.grpc as grpcclient
import yaml
from tritonclient.utils import InferenceServerException

from gateway.backends.local import LocalTriton
from gateway.backends.triton import REPOSITORY_KEY_HEADER
from gateway.config import GatewayConfig, StateConfig, TelemetryConfig
from gateway.core.rollout import Phase
from gateway.rollouts import LATENCY, REQUESTS, RolloutRun
from orchid_tools import cli
from orchid_tools.rollout import rollout_call
from tests.conftest import (
    LUMEN_KEY,
    MODEL_REPOSITORY,
    OPS_KEY,
    ORCHID_KEY,
    TIME_FACTOR,
    ThreadedGateway,
    bearer,
    gateway_config,
)
from tests.redis_server import RedisServer, redis_server

pytestmark = pytest.mark.slow
__all__ = ["redis_server"]  # the fixture, imported

CANDIDATES: dict[str, dict[str, str]] = {
    "full-v19": {"instances": "4"},  # as many devices as full-v18: it may be promoted
    # 100x slower: a short canary (256 / 16 tokens, 1.8 ms at the tests' factor) takes 184 ms, so
    # its p95 ratio stays over 2 unless the current version's p95 is over 92 ms (see the test).
    "full-v19-slow": {"time_factor_scale": "100"},
    "full-v19-badload": {},
    "full-v19-oom": {},
    "full-v19-small": {},  # one instance: fewer devices than full-v18, never promoted on its own
    # Correct, but 200x slower on inputs over 1,024 tokens (the long bucket): past any deadline.
    "full-v19-slowlong": {"instances": "4", "slow_long_input_tokens": "1024", "slow_long_scale": "200"},
    # Drifts after its warm-up: every 3rd execution answers tokens outside the vocabulary.
    "full-v19-drift": {"invalid_output_after": str(3), "invalid_output_every": "3"},
}
# Triton's repository API is restricted to callers with this key (the gateway reads it from
# the environment variable its backend config names).
REPOSITORY_KEY = "rollout-test-repository-key"
KEY_ENV = "ORCHID_TEST_REPOSITORY_KEY"
REPOSITORY = {REPOSITORY_KEY_HEADER: REPOSITORY_KEY}
EXPLICIT = (
    "--model-control-mode=explicit",
    "--strict-readiness=false",
    "--load-model=full-v18",
    "--load-model=compact-v11",
    f"--grpc-restricted-protocol=model-repository:orchid-repository-key={REPOSITORY_KEY}",
)
WARMUP_REQUESTS = 3  # the rollout below warms with 2 short + 1 long


@dataclass
class Stack:
    triton: LocalTriton
    faults: Path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("rollout")
    repository = root / "repo" / "model_repository"
    for model in ("full-v18", "compact-v11"):
        shutil.copytree(
            MODEL_REPOSITORY / model, repository / model, ignore=shutil.ignore_patterns("__pycache__")
        )
    shutil.copytree(
        MODEL_REPOSITORY.parent / "emulator",
        root / "repo" / "emulator",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    source = (MODEL_REPOSITORY / "full-v19" / "config.pbtxt").read_text()
    for name, extra in CANDIDATES.items():
        shutil.copytree(
            MODEL_REPOSITORY / "full-v19" / "1",
            repository / name / "1",
            ignore=shutil.ignore_patterns("__pycache__"),
        )
        config = source.replace('name: "full-v19"', f'name: "{name}"')
        if "instances" in extra:
            config = config.replace(
                "count: 1, kind: KIND_CPU", f"count: {extra['instances']}, kind: KIND_CPU"
            )
        for key, value in extra.items():
            if key == "instances":
                continue
            config = config.replace(
                "parameters [\n",
                f'parameters [\n  {{ key: "{key}", value: {{ string_value: "{value}" }} }},\n',
            )
        (repository / name / "config.pbtxt").write_text(config)
    faults = root / "faults"
    faults.mkdir()
    (faults / "full-v19-badload.fail_load").write_text("")
    (faults / "full-v19-oom.fail_execute").write_text(str(WARMUP_REQUESTS))
    triton = LocalTriton(
        repository,
        root / "triton",
        time_factor=TIME_FACTOR,
        # Explicit model control, and a server whose readiness does not hang on every model's:
        # with strict readiness a candidate that fails to load would make it report not ready.
        extra_args=EXPLICIT,
        env={"ORCHID_FAULT_DIR": str(faults)},
    )
    triton.start()
    os.environ[KEY_ENV] = REPOSITORY_KEY
    try:
        yield Stack(triton, faults)
    finally:
        del os.environ[KEY_ENV]
        triton.kill()  # disposable: see conftest.own_triton


def repository_states(address: str) -> dict[str, str]:
    with grpcclient.InferenceServerClient(address) as client:
        index = client.get_model_repository_index(headers=REPOSITORY, as_json=True)
    return {m["name"]: m.get("state", "") for m in index.get("models", [])}


def rollout_config(address: str, **changes: Any) -> GatewayConfig:
    """The tests' gateway config, its backend holding the repository key (by environment)."""
    config = gateway_config(address, **changes)
    backend = config.backends[0].model_copy(update={"repository_key_env": KEY_ENV})
    return config.model_copy(update={"backends": (backend,)})


@pytest.fixture
def gateway(stack: Stack, tmp_path: Path) -> Iterator[ThreadedGateway]:
    with grpcclient.InferenceServerClient(stack.triton.address) as client:
        client.load_model("full-v18", headers=REPOSITORY)  # a promotion earlier unloaded it
        for name in CANDIDATES:
            if repository_states(stack.triton.address).get(name) == "READY":
                client.unload_model(name, headers=REPOSITORY)
    telemetry = TelemetryConfig(decision_log=str(tmp_path / "decisions.jsonl"))
    running = ThreadedGateway(rollout_config(stack.triton.address, telemetry=telemetry))
    running.start()
    try:
        yield running
    finally:
        running.stop()


# --------------------------------------------------------------------------- steady load


@dataclass(frozen=True)
class Answer:
    sent: float
    received: float
    tenant: str
    bucket: str
    error: str
    version: str
    reason: str


VOCAB = 32_000  # the emulator's tokens are 0..31999: anything else is an invalid answer


@dataclass
class SteadyLoad:
    """Closed-loop clients: orchid short (the cohort), lumen short, orchid long. Every answer
    is checked by the client itself (the output's shape and its tokens in the vocabulary):
    an invalid answer is recorded as a failure like an error."""

    address: str
    long_timeout_s: float = 2.0  # the long client's deadline (the short ones': 2 s)
    answers: list[Answer] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for tenant, key, tokens in (
            ("orchid", ORCHID_KEY, 256),
            ("lumen", LUMEN_KEY, 256),
            ("orchid", ORCHID_KEY, 2048),
        ):
            thread = threading.Thread(target=self._client, args=(tenant, key, tokens), daemon=True)
            thread.start()
            self.threads.append(thread)

    def _client(self, tenant: str, key: str, tokens: int) -> None:
        bucket = "long" if tokens > 1024 else "short"
        data = (np.arange(tokens, dtype=np.int32) % 1000).reshape(1, tokens)
        with grpcclient.InferenceServerClient(self.address) as client:
            while not self.stop.is_set():
                tensor = grpcclient.InferInput("INPUT_IDS", [1, tokens], "INT32")
                tensor.set_data_from_numpy(data)
                sent = time.monotonic()
                try:
                    result = client.infer(
                        "full-v18",
                        [tensor],
                        headers=bearer(key),
                        parameters={"orchid.max_output_tokens": 16},
                        client_timeout=self.long_timeout_s if bucket == "long" else 2.0,
                    )
                except InferenceServerException as exc:
                    self.answers.append(Answer(sent, time.monotonic(), tenant, bucket, str(exc), "", ""))
                    continue
                params = result.get_response().parameters
                output = result.as_numpy("OUTPUT_IDS")
                invalid = (
                    ""
                    if output is not None
                    and output.shape == (1, 16)
                    and 0 <= output.min() <= output.max() < VOCAB
                    else "invalid answer"
                )
                self.answers.append(
                    Answer(
                        sent,
                        time.monotonic(),
                        tenant,
                        bucket,
                        invalid,
                        params["orchid.model_version"].string_param,
                        params["orchid.route_reason"].string_param,
                    )
                )

    def finish(self) -> list[Answer]:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=10)
        return list(self.answers)


def rollout_file(
    tmp_path: Path, name: str, candidate: str, *, max_ratio: float, interval_s: float = 0.5
) -> Path:
    spec: dict[str, Any] = {
        "name": name,
        "route": "full-v18",
        "current": {"backend_model": "full-v18", "version": "1"},
        "candidate": {"backend_model": candidate, "version": "1", "label": candidate},
        "memory": {"min_live_tokens": 100_000},
        "warmup": {
            "shapes": [
                {"bucket": "short", "input_tokens": 256, "output_tokens": 16, "repeat": 2},
                {"bucket": "long", "input_tokens": 2048, "output_tokens": 16},
            ],
            "outputs": {
                "OUTPUT_IDS": {"datatype": "INT32", "shape": ["items", "output_tokens"], "min_value": 0}
            },
        },
        "steps": [
            {
                "kind": "canary",
                "cohorts": [{"classes": ["interactive"], "buckets": ["short"], "tenants": ["orchid"]}],
                "weight": 0.5,
                "intervals": 2,
            },
            {"kind": "promote"},
        ],
        "analysis": {"interval_s": interval_s, "min_samples": 5},
        "guardrails": [
            {"metric": "completion_p95_ratio", "max": max_ratio, "failures": 2},
            {"metric": "error_rate_delta", "max": 0.0, "failures": 1},
            {"metric": "invalid_output_rate", "max": 0.0, "failures": 1},
        ],
        "drain": {"max_wait_s": 20},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def rehearse(
    gateway: ThreadedGateway, path: Path, *, long_timeout_s: float = 2.0
) -> tuple[RolloutRun, list[Answer]]:
    """Start the rollout by the admin RPC under the steady load; wait for its task to end."""
    load = SteadyLoad(gateway.address, long_timeout_s=long_timeout_s)
    load.start()
    try:
        wait_until(lambda: len(load.answers) >= 20, "the load running before the rollout starts")
        reply = rollout_call(gateway.address, OPS_KEY, "start", str(path))
        gw = gateway.server.gateway
        assert gw is not None
        run = gateway.call_soon(lambda: gw.rollouts.run_named(reply.name))
        assert run.task is not None
        gateway.call(asyncio.wait_for(asyncio.shield(run.task), 60))
        # The load keeps going a while after the end: what is served now is the outcome.
        settled = len(load.answers)
        wait_until(lambda: len(load.answers) >= settled + 20, "20 answers after the rollout's end")
    finally:
        answers = load.finish()
    return run, answers


WAIT_S = 60.0  # the longest any wait here may take (a rollout's task is awaited as long)


def wait_until(condition: Callable[[], bool], what: str, *, timeout_s: float = WAIT_S) -> None:
    """Poll ``condition`` (every 10 ms) until it holds; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s"
        time.sleep(0.01)  # the poll interval of a bounded condition wait


def verdicts(rollout: Any) -> list[tuple[int, int, dict[str, float], tuple[str, ...]]]:
    """Each conclusive interval's samples (candidate, current), values and failed metrics."""
    return [
        (i.candidate_samples, i.current_samples, {k: round(v, 2) for k, v in i.values.items()}, i.failed)
        for i in rollout.intervals
        if i.conclusive
    ]


def no_failures(answers: list[Answer]) -> None:
    failed = [a for a in answers if a.error]
    assert not failed, f"{len(failed)} of {len(answers)} client requests failed: {failed[:3]}"


# --------------------------------------------------------------------------- tests


def test_good_candidate_warms_canaries_its_cohort_and_is_promoted_then_the_old_drains(
    gateway: ThreadedGateway, stack: Stack, tmp_path: Path
) -> None:
    # Intervals of 2 s: each version's p95 over about 60 samples (the 4th largest), not the
    # largest of 14-18 (0.5 s), which one stall of the loaded machine on the candidate's side
    # put over 4x the current's (seen: [(), ('completion_p95_ratio',), ()]).
    path = rollout_file(tmp_path, "good", "full-v19", max_ratio=4.0, interval_s=2.0)
    run, answers = rehearse(gateway, path)
    rollout = run.rollout
    assert rollout.phase is Phase.COMPLETE, rollout.reason
    assert rollout.ready_at is not None and rollout.promoted_at is not None
    no_failures(answers)
    # Not used before its warm-up passed: nothing answered by the candidate before ready.
    served = [a for a in answers if a.version == "full-v19"]
    assert served and min(a.received for a in served) > rollout.ready_at
    # The canary served only the declared cohort (orchid, short, interactive) until promotion.
    canaries = [a for a in answers if a.reason == "canary"]
    assert canaries and {(a.tenant, a.bucket) for a in canaries} == {("orchid", "short")}
    before = [
        a for a in answers if a.received < rollout.promoted_at and (a.tenant, a.bucket) != ("orchid", "short")
    ]
    assert before and all(a.version == "1" for a in before)
    # Promoted: everything sent after the switch is the candidate's.
    after = [a for a in answers if a.sent > rollout.promoted_at]
    assert after and all(a.version == "full-v19" for a in after)
    # The old version was unloaded only once drained, and the time until then is reported.
    assert rollout.retired_drained_at is not None and rollout.retired_unloaded_at is not None
    assert rollout.promoted_at <= rollout.retired_drained_at <= rollout.retired_unloaded_at
    assert all(a.received <= rollout.retired_unloaded_at for a in answers if a.version == "1")
    report = rollout.report()
    assert report["safe_to_remove_after_s"] is not None and report["unload_s"] is not None
    assert repository_states(stack.triton.address)["full-v18"] == "UNAVAILABLE"
    assert repository_states(stack.triton.address)["full-v19"] == "READY"
    # Two conclusive passing intervals of the canary step, then promotion.
    conclusive = [i for i in rollout.intervals if i.conclusive]
    print(f"\ngood candidate's intervals: {verdicts(rollout)}")
    assert len(conclusive) == 2 and not any(i.failed for i in conclusive), verdicts(rollout)
    # The status page's JSON shows it.
    board = gateway.server.status_board
    rollouts = gateway.call_soon(lambda: board.snapshot()["rollouts"])
    assert rollouts == [
        {
            "name": "good",
            "route": "full-v18",
            "candidate": "full-v19",
            "phase": "complete",
            "step": 2,
            "steps": 2,
            "reason": "",
        }
    ]
    # The decision log and the metrics split by version.
    decisions = [json.loads(line) for line in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    canary_lines = [d for d in decisions if d["outcome"] == "admit:canary"]
    assert len(canary_lines) == len(canaries)
    assert {(d["tenant"], d["model_version"]) for d in canary_lines} == {("orchid", "full-v19")}
    assert {d["model_version"] for d in decisions if d["outcome"] == "admit:primary"} == {"1", "full-v19"}
    for version in ("1", "full-v19"):
        assert REQUESTS.labels("good", version, "ok")._value.get() > 0
        assert LATENCY.labels("good", version, "completion")._sum.get() > 0


def test_slow_candidate_is_rolled_back_within_its_analysis_intervals(
    gateway: ThreadedGateway, stack: Stack, tmp_path: Path
) -> None:
    # Intervals of 3 s: about 15 canaries of 184 ms a side (min_samples 5 even if every request
    # took 100 ms more); an interval passes only if the current version's p95 (the largest of
    # its ~15) is over 92 ms. At 25x (46 ms) and 0.5 s intervals, one current answer past 23 ms
    # let an interval pass (ratios measured 4-10 per interval with 7-9 samples a side).
    path = rollout_file(tmp_path, "slow", "full-v19-slow", max_ratio=2.0, interval_s=3.0)
    run, answers = rehearse(gateway, path)
    rollout = run.rollout
    assert rollout.phase is Phase.ROLLED_BACK, rollout.report()
    assert rollout.reason.startswith("guardrail completion_p95_ratio"), rollout.reason
    no_failures(answers)
    # Rolled back at the close of the second consecutive failing interval (failures: 2).
    conclusive = [i for i in rollout.intervals if i.conclusive]
    print(f"\nslow candidate's intervals: {verdicts(rollout)}")
    assert len(conclusive) == 2, verdicts(rollout)
    assert all(i.failed == ("completion_p95_ratio",) for i in conclusive), verdicts(rollout)
    assert rollout.intervals[-1] is conclusive[-1]  # no interval closed after the second
    assert rollout.rolled_back_at is not None and rollout.rolled_back_at >= conclusive[-1].ended_at
    # Routed back at once: nothing sent after the rollback went to the candidate.
    assert rollout.rolled_back_at is not None
    assert all(a.version == "1" for a in answers if a.sent > rollout.rolled_back_at)
    assert any(a.version == "full-v19-slow" for a in answers)
    # The candidate drained, then was unloaded; the report says how long that took.
    assert rollout.retired_unloaded_at is not None and rollout.unload_s is not None
    assert repository_states(stack.triton.address)["full-v19-slow"] == "UNAVAILABLE"
    assert repository_states(stack.triton.address)["full-v18"] == "READY"


def test_a_candidate_slow_only_on_long_inputs_is_rolled_back_at_the_long_step_and_no_caller_waits(
    gateway: ThreadedGateway, stack: Stack, tmp_path: Path
) -> None:
    """The issue's first bad candidate: correct, on time for short inputs, 200x slower for
    long ones (2.2 s against the long caller's 1 s deadline). The short-only step passes;
    the step whose cohort has long inputs sends long canaries under the hedge's budget, each
    times out inside it and is answered by the current version in time, and the timeouts,
    counted as failing samples, roll the candidate back before that step can pass."""
    path = rollout_file(tmp_path, "slowlong", "full-v19-slowlong", max_ratio=4.0)
    data = yaml.safe_load(path.read_text())
    orchid_short = data["steps"][0]
    data["steps"] = [
        orchid_short,
        {
            **orchid_short,
            "cohorts": [{"classes": ["interactive"], "buckets": ["short", "long"], "tenants": ["orchid"]}],
        },
        {"kind": "promote"},
    ]
    data["hedge"] = {"reserve_ms": 100}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    run, answers = rehearse(gateway, path, long_timeout_s=1.0)
    rollout = run.rollout
    assert rollout.phase is Phase.ROLLED_BACK, rollout.report()
    assert rollout.step == 1, rollout.report()  # the second step: its cohort has long inputs
    assert rollout.reason.startswith("guardrail error_rate_delta"), rollout.reason
    assert "timed out" in rollout.reason, rollout.reason
    # Every caller got an on-time, valid answer (a late one is the client's own
    # DEADLINE_EXCEEDED, a failure): the long canaries were answered again by the current
    # version inside the caller's deadline, and say so.
    no_failures(answers)
    hedged = [a for a in answers if a.reason == "canary_hedge"]
    assert hedged and {(a.tenant, a.bucket, a.version) for a in hedged} == {("orchid", "long", "1")}
    assert not any(a.version == "full-v19-slowlong" and a.bucket == "long" for a in answers)
    # The hedge's cost is the rollout's, and reported.
    report = rollout.report()
    assert report["hedged"].get("timeout", 0) == len(hedged), report["hedged"]  # type: ignore[union-attr]
    assert isinstance(report["hedge_device_ms"], float) and report["hedge_device_ms"] > 0
    assert report["hedge_unanswered"] == 0
    assert REQUESTS.labels("slowlong", "full-v19-slowlong", "timed_out")._value.get() == len(hedged)
    assert repository_states(stack.triton.address)["full-v18"] == "READY"


def test_a_drifting_candidates_invalid_answers_never_reach_a_caller(
    gateway: ThreadedGateway, stack: Stack, tmp_path: Path
) -> None:
    """The issue's second bad candidate: valid through its warm-up, then every third answer
    is outside the declared outputs. Each invalid canary answer is answered again by the
    current version (the caller checks every answer it gets), and the candidate is rolled
    back on the first conclusive interval."""
    path = rollout_file(tmp_path, "drift", "full-v19-drift", max_ratio=4.0)
    data = yaml.safe_load(path.read_text())
    data["warmup"]["outputs"]["OUTPUT_IDS"]["max_value"] = VOCAB - 1
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    run, answers = rehearse(gateway, path)
    rollout = run.rollout
    assert rollout.ready_at is not None  # the warm-up passed: the drift starts after it
    assert rollout.phase is Phase.ROLLED_BACK, rollout.report()
    assert rollout.reason.startswith("guardrail invalid_output_rate"), rollout.reason
    no_failures(answers)  # no error, and no invalid answer, reached a caller
    hedged = [a for a in answers if a.reason == "canary_hedge"]
    assert hedged and all(a.version == "1" for a in hedged)
    assert rollout.hedged.get("invalid_output", 0) == len(hedged)
    assert any(a.version == "full-v19-drift" for a in answers)  # its valid answers did serve


def test_a_gateway_restart_mid_rollout_resumes_it_from_its_durable_state(
    stack: Stack, tmp_path: Path
) -> None:
    """A gateway with ``rollouts_state_dir`` starts a rollout and stops while its canary step
    runs (no traffic yet: the step cannot pass). A new gateway on the same state resumes it
    at that step (the candidate still READY in Triton, warmed again), and under load the
    rollout completes: promoted, the old version drained and unloaded."""
    with grpcclient.InferenceServerClient(stack.triton.address) as client:
        client.load_model("full-v18", headers=REPOSITORY)  # a promotion earlier unloaded it
        for name in CANDIDATES:
            if repository_states(stack.triton.address).get(name) == "READY":
                client.unload_model(name, headers=REPOSITORY)
    config = rollout_config(stack.triton.address, rollouts_state_dir=tmp_path / "state")
    path = rollout_file(tmp_path, "restarted", "full-v19", max_ratio=4.0)
    first = ThreadedGateway(config)
    first.start()
    try:
        rollout_call(first.address, OPS_KEY, "start", str(path))
        gw = first.server.gateway
        assert gw is not None
        run = first.call_soon(lambda: gw.rollouts.run_named("restarted"))

        def in_canary() -> bool:
            assert run.task is not None and not run.task.done(), run.rollout.report()
            return run.rollout.phase is Phase.CANARY

        wait_until(in_canary, "the rollout in its canary step")
    finally:
        first.stop()
    saved = json.loads((tmp_path / "state" / "restarted.json").read_text())
    assert (saved["phase"], saved["step"]) == ("canary", 0)
    assert repository_states(stack.triton.address)["full-v19"] == "READY"  # nothing unloaded it
    second = ThreadedGateway(config)
    second.start()
    load = SteadyLoad(second.address)
    try:
        gw2 = second.server.gateway
        assert gw2 is not None
        resumed = second.call_soon(lambda: gw2.rollouts.run_named("restarted"))
        assert resumed is not run and resumed.task is not None
        load.start()
        second.call(asyncio.wait_for(asyncio.shield(resumed.task), 60))
    finally:
        answers = load.finish()
        second.stop()
        states = repository_states(stack.triton.address)
        with grpcclient.InferenceServerClient(stack.triton.address) as client:  # as the others expect it
            client.load_model("full-v18", headers=REPOSITORY)
            client.unload_model("full-v19", headers=REPOSITORY)
    rollout = resumed.rollout
    assert rollout.phase is Phase.COMPLETE, rollout.report()
    assert rollout.timeline[0][1] == "resumed after a gateway restart at step 1/2"
    assert any(
        text == "promoted (all steps passed): full-v19 serves full-v18" for _, text in rollout.timeline
    )
    no_failures(answers)
    assert any(a.version == "full-v19" and a.reason == "canary" for a in answers)
    assert json.loads((tmp_path / "state" / "restarted.json").read_text())["phase"] == "complete"
    assert (states["full-v18"], states["full-v19"]) == ("UNAVAILABLE", "READY")  # the old one retired


@pytest.mark.parametrize("departure", ["stopped", "crashed"])
def test_two_replicas_on_redis_run_one_rollout_and_the_survivor_finishes_it(
    stack: Stack, tmp_path: Path, redis_server: RedisServer, departure: str
) -> None:
    """Two replicas share a Redis. Replica A owns the rollout (B's start of it is refused,
    naming A); B follows A's step, sends canaries by it and reports its samples, which A's
    analysis counts (only B has traffic). A goes away mid-rollout: stopped (its lease
    released), or crashed as far as Redis can tell (its lease left to expire, 3 s); B takes
    the lease, resumes at the step from the record in Redis and completes the rollout, with
    no client failure; the record in Redis and B agree it is complete."""
    reset_stack(stack)
    state = StateConfig(
        backend="redis",
        url=redis_server.url,
        key_prefix=f"rollout-{uuid.uuid4().hex[:8]}:",
        lease_ttl_ms=3000,
        call_timeout_ms=500,
    )
    config = rollout_config(stack.triton.address, state=state)
    path = rollout_file(tmp_path, "fleet", "full-v19", max_ratio=4.0)
    data = yaml.safe_load(path.read_text())
    data["steps"][0]["intervals"] = 4
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    a, b = ThreadedGateway(config), ThreadedGateway(config)
    a.start()
    b.start()
    running = [a, b]
    load = SteadyLoad(b.address)
    try:
        gwa, gwb = a.server.gateway, b.server.gateway
        assert gwa is not None and gwb is not None
        rollout_call(a.address, OPS_KEY, "start", str(path))
        with pytest.raises(grpc.RpcError) as refused:
            rollout_call(b.address, OPS_KEY, "start", str(path))
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "is rolling out on replica" in refused.value.details()
        owner = a.call_soon(lambda: gwa.rollouts.run_named("fleet"))
        load.start()
        # A's analysis fills with B's samples (A itself has no traffic).

        def analysed() -> bool:
            assert owner.task is not None and not owner.task.done(), owner.rollout.report()
            return any(i.conclusive and i.candidate_samples for i in owner.rollout.intervals)

        wait_until(analysed, "a conclusive interval of B's samples in A's analysis")
        assert owner.rollout.phase is Phase.CANARY, owner.rollout.report()
        follower = b.call_soon(lambda: gwb.rollouts.run_named("fleet"))
        assert follower.follower and follower.rollout.phase is Phase.CANARY, follower.rollout.report()
        with pytest.raises(grpc.RpcError) as not_here:
            rollout_call(b.address, OPS_KEY, "promote", "fleet")
        assert not_here.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "owned by another replica" in not_here.value.details()
        if departure == "crashed":  # nothing tells Redis: the lease must expire

            async def keep(route: str) -> None:
                return None

            fleet = gwa.rollouts.fleet
            assert fleet is not None
            a.call_soon(lambda: setattr(fleet, "release", keep))
        running.remove(a)
        a.stop()  # mid-rollout: the owner goes away
        taken = follower

        def took_over() -> bool:
            nonlocal taken
            taken = b.call_soon(lambda: gwb.rollouts.run_named("fleet"))
            return taken is not follower and taken.task is not None

        # Within the lease (3 s, crashed) and a watcher round; bounded like every wait here.
        wait_until(took_over, "B's take-over of the rollout")
        assert taken.task is not None
        b.call(asyncio.wait_for(asyncio.shield(taken.task), 60))
        # Its own record, ended here: a round of B's watcher does not make it follow itself.
        fleet_b = gwb.rollouts.fleet
        assert fleet_b is not None
        b.call(fleet_b._round())
        assert b.call_soon(lambda: gwb.rollouts.run_named("fleet")) is taken
    finally:
        answers = load.finish()
        for gateway in running:
            gateway.stop()
        reset_stack(stack)
    rollout = taken.rollout
    assert rollout.phase is Phase.COMPLETE, rollout.report()
    # Taken over in the canary step, or (A's graceful stop drains its listener first, and
    # its rollout may pass its last intervals meanwhile) after A promoted: B then retires
    # full-v18. Either way B finishes what A started.
    assert rollout.timeline[0][1] in (
        "resumed by this replica (its owner replica gone) at step 1/2",
        "resumed by this replica (its owner replica gone): full-v19 serves full-v18",
    ), rollout.timeline
    no_failures(answers)
    assert any(a.version == "full-v19" and a.reason == "canary" for a in answers)
    record = json.loads(
        asyncio.run(_redis_get(redis_server.url, f"{state.key_prefix}rollout-state:full-v18")) or "{}"
    )
    assert (record.get("phase"), record.get("step")) == ("complete", 1)


async def _redis_get(url: str, key: str) -> bytes | None:
    client = aioredis.Redis.from_url(url)
    try:
        value: bytes | None = await client.get(key)
        return value
    finally:
        await client.aclose()


def reset_stack(stack: Stack) -> None:
    """full-v18 loaded, no candidate: as every test here expects to begin."""
    with grpcclient.InferenceServerClient(stack.triton.address) as client:
        client.load_model("full-v18", headers=REPOSITORY)
        for name in CANDIDATES:
            if repository_states(stack.triton.address).get(name) == "READY":
                client.unload_model(name, headers=REPOSITORY)


def test_allocation_failure_at_load_routes_back(
    gateway: ThreadedGateway, stack: Stack, tmp_path: Path
) -> None:
    run, answers = rehearse(gateway, rollout_file(tmp_path, "badload", "full-v19-badload", max_ratio=4.0))
    rollout = run.rollout
    assert rollout.phase is Phase.ROLLED_BACK
    assert rollout.reason.startswith("load failed:") and "CUDA out of memory" in rollout.reason
    assert rollout.ready_at is None
    no_failures(answers)
    assert all(a.version == "1" for a in answers)


def test_allocation_failure_on_first_canary_execution_routes_back(
    gateway: ThreadedGateway, stack: Stack, tmp_path: Path
) -> None:
    run, answers = rehearse(gateway, rollout_file(tmp_path, "oom", "full-v19-oom", max_ratio=4.0))
    rollout = run.rollout
    assert rollout.ready_at is not None  # the warm-up passed: the fault starts after it
    assert rollout.phase is Phase.ROLLED_BACK
    assert (
        rollout.reason.startswith("allocation failure on full-v19-oom: ")
        and "out of memory" in rollout.reason
    )
    # The canary that met it was answered by the current version: no client saw the failure.
    no_failures(answers)
    assert all(a.version == "1" for a in answers)
    assert rollout.diverted >= 1


def test_two_versions_that_do_not_fit_are_refused_before_loading(stack: Stack, tmp_path: Path) -> None:
    config = rollout_config(stack.triton.address)
    small = config.backends[0].model_copy(update={"device_memory_gib": 64.0})
    running = ThreadedGateway(config.model_copy(update={"backends": (small,)}))
    running.start()
    try:
        path = rollout_file(tmp_path, "tight", "full-v19", max_ratio=4.0)
        with pytest.raises(grpc.RpcError) as caught:
            rollout_call(running.address, OPS_KEY, "start", str(path))
        assert caught.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "do not both fit a device of backend 'local'" in caught.value.details()
        assert "a rollback would wait for full-v19 to unload" in caught.value.details()
        assert repository_states(stack.triton.address).get("full-v19") != "READY"
    finally:
        running.stop()


def test_admin_rpc_validates_rollout_files_with_locations(
    stack: Stack, gateway: ThreadedGateway, tmp_path: Path
) -> None:
    path = rollout_file(tmp_path, "bad", "full-v19", max_ratio=4.0)
    text = path.read_text()
    assert text.count("- orchid") == 1
    path.write_text(text.replace("- orchid", "- nobody"))
    with pytest.raises(grpc.RpcError) as caught:
        rollout_call(gateway.address, OPS_KEY, "start", str(path))
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    line = next(i for i, t in enumerate(text.splitlines(), 1) if "- orchid" in t)
    assert f"{path}:{line}:" in caught.value.details()
    assert "steps.0.cohorts.0.tenants.0: unknown tenant 'nobody'" in caught.value.details()
    with pytest.raises(grpc.RpcError) as denied:
        rollout_call(gateway.address, ORCHID_KEY, "status", "good")
    assert denied.value.code() is grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.RpcError) as unknown:
        rollout_call(gateway.address, OPS_KEY, "promote", "never-started")
    assert unknown.value.code() is grpc.StatusCode.NOT_FOUND


def test_shadow_step_mirrors_off_the_callers_path_until_an_operator_rolls_back(
    gateway: ThreadedGateway, stack: Stack, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = rollout_file(tmp_path, "shadowed", "full-v19", max_ratio=4.0)
    data = yaml.safe_load(path.read_text())
    data["steps"][0] = {**data["steps"][0], "kind": "shadow", "intervals": 1000}  # holds until told
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    gw = gateway.server.gateway
    assert gw is not None
    load = SteadyLoad(gateway.address)
    load.start()
    try:
        reply = rollout_call(gateway.address, OPS_KEY, "start", str(path))
        assert reply.phase == "loading"
        run = gateway.call_soon(lambda: gw.rollouts.run_named("shadowed"))

        def shadowing() -> bool:
            assert run.task is not None and not run.task.done(), run.rollout.report()
            return run.rollout.shadowed >= 10 and bool(run.rollout.intervals)

        wait_until(shadowing, "10 mirrored requests and an interval of the shadow step")
        status = rollout_call(gateway.address, OPS_KEY, "status", "shadowed")
        assert status.phase == "shadow"
        reply = rollout_call(gateway.address, OPS_KEY, "rollback", str(path))  # the file names it
        assert reply.phase == "rolled_back" and reply.reason == "rolled back by an operator"
        assert run.task is not None
        gateway.call(asyncio.wait_for(asyncio.shield(run.task), 60))
    finally:
        answers = load.finish()
    no_failures(answers)
    # Mirrored answers were discarded: every caller got the current version.
    assert answers and all(a.version == "1" and a.reason == "primary" for a in answers)
    assert run.rollout.shadowed >= 10
    report = json.loads(rollout_call(gateway.address, OPS_KEY, "status", "shadowed").report_json)
    assert report["phase"] == "rolled_back" and report["unload_s"] is not None
    assert sum(i["candidate_samples"] for i in report["intervals"]) > 0
    assert repository_states(stack.triton.address)["full-v19"] == "UNAVAILABLE"
    # The command line reads the same status.
    assert cli.main(["rollout", "status", "shadowed", "--address", gateway.address, "--key", OPS_KEY]) == 0
    out = capsys.readouterr().out
    assert out.startswith("rollout shadowed: rolled_back (rolled back by an operator)\n")
    assert "warm-up passed: candidate ready" in out and "retired version unloaded" in out


def test_a_smaller_candidate_is_held_before_promotion_until_an_operator_promotes(
    gateway: ThreadedGateway, stack: Stack, tmp_path: Path
) -> None:
    path = rollout_file(tmp_path, "small", "full-v19-small", max_ratio=4.0)
    gw = gateway.server.gateway
    assert gw is not None
    load = SteadyLoad(gateway.address)
    load.start()
    try:
        rollout_call(gateway.address, OPS_KEY, "start", str(path))
        run = gateway.call_soon(lambda: gw.rollouts.run_named("small"))
        held = "promotion held: full-v19-small has 1 device(s) on backend 'local', full-v18 has 4"

        def holding() -> bool:
            assert run.task is not None and not run.task.done(), run.rollout.report()
            return any(text.startswith(held) for _, text in run.rollout.timeline)

        wait_until(holding, "promotion held for the smaller candidate")
        assert rollout_call(gateway.address, OPS_KEY, "status", "small").phase == "canary"
        reply = rollout_call(gateway.address, OPS_KEY, "promote", "small")
        assert reply.phase == "promoted"
        assert run.task is not None
        gateway.call(asyncio.wait_for(asyncio.shield(run.task), 60))
        with pytest.raises(grpc.RpcError) as refused:
            rollout_call(gateway.address, OPS_KEY, "abort", "small")
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "is not running (complete)" in refused.value.details()
    finally:
        answers = load.finish()
    no_failures(answers)
    assert run.rollout.phase is Phase.COMPLETE
    assert run.rollout.timeline[-3][1] == "promoted (operator): full-v19-small serves full-v18"


def test_the_repository_api_needs_its_key(stack: Stack, tmp_path: Path) -> None:
    """Triton's restricted model-repository protocol refuses a caller without the key; the
    gateway sends it (its backend's repository_key_env), so its rollouts load and unload."""
    with (
        grpcclient.InferenceServerClient(stack.triton.address) as client,
        pytest.raises(InferenceServerException, match="triton-grpc-protocol-orchid-repository-key"),
    ):
        client.load_model("full-v19")
    assert repository_states(stack.triton.address).get("full-v19") != "READY"
    config = gateway_config(stack.triton.address)  # no key: the load is refused, nothing changes
    running = ThreadedGateway(config)
    running.start()
    try:
        path = rollout_file(tmp_path, "keyless", "full-v19", max_ratio=4.0)
        rollout_call(running.address, OPS_KEY, "start", str(path))
        gw = running.server.gateway
        assert gw is not None
        run = running.call_soon(lambda: gw.rollouts.run_named("keyless"))
        assert run.task is not None
        running.call(asyncio.wait_for(asyncio.shield(run.task), 60))
        assert run.rollout.phase is Phase.ROLLED_BACK
        assert run.rollout.reason.startswith("load failed: loading 'full-v19' failed:")
    finally:
        running.stop()
