"""Rehearse a version change on the example stack under load (issue 16's seed).

What it does
    Starts ``orchid-gateway serve`` on the example stack with its local Triton in explicit
    model-control mode (full-v18, compact-v11 and the kestrel/stream models loaded; the
    candidate full-v19 not, and deployed with 4 instances like full-v18 in a copy of the
    repository), the emulator's forced-failure directory (``ORCHID_FAULT_DIR``) set, and
    ``rollouts/full-v19.yaml`` declared. Open-loop Poisson traffic runs throughout
    (tenants orchid and lumen, 85 % short 256/64 and 15 % long 4,096/64 requests, a share of
    lumen's marked ``orchid.risk_class: regulated``: the high-risk cohort). Then:

    1. the rollout starts: full-v19 is loaded and warmed while full-v18 serves the traffic;
    2. shadow of short interactive requests, then a canary of the high-risk cohorts;
    3. once the canary serves, an allocation failure is forced on full-v19 (its next
       execution fails ``CUDA out of memory``): the gateway answers the failed canary from
       full-v18, rolls back at once, drains and unloads full-v19;
    4. the fault is cleared and the same rollout runs again to the end: promotion, the old
       version drains and is unloaded; the report gives the time until it could be removed.

    Prints the timeline (gateway-side, from the rollout reports) and, per phase, the
    requests, refusals, failures and the on-time attainment of admitted work (answered
    within the deadline / answered), the target being >= 99 %.

    ``--bad-candidates`` runs issue 26's two bad candidates instead, each rolled out with a
    copy of ``rollouts/full-v19.yaml`` under the same kind of traffic (by default 136 req/s,
    80 % short / 20 % long: 65 % of full-v18's protected envelope): ``full-v19-slowlong``
    (correct, 4x slower on inputs over 1,024 tokens) and ``full-v19-drift`` (every fifth
    execution of an instance after its warm-up answers tokens outside the vocabulary). Each
    must be rolled back, never promoted, with no caller error and no invalid answer reaching a
    caller (every answer's tokens are checked by the client), and on-time attainment of
    admitted work >= 95 %; the exit status is 1 otherwise.

    Every rollout's line gives the hedge's cost: canaries answered again by the current
    version (by why) and the device time their candidate attempts held (the rollout's, not
    the tenant's).

Usage
    python bench/rehearsal.py [--rate 120] [--time-factor 0.1] [--deadline-ms 200] [--seed 16]
    python bench/rehearsal.py --bad-candidates [--rate 136] [--long-share 0.2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc.aio as aioclient
import yaml
from tritonclient.utils import InferenceServerException

from gateway.backends.local import free_port
from orchid_tools.evidence import publish_evidence
from orchid_tools.harness import GatewayProcess, send_open_loop
from orchid_tools.rollout import rollout_call

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "orchid"
KEYS = {"orchid": "orchid-demo-key-orchid", "lumen": "orchid-demo-key-lumen"}
ADMIN_KEY = "orchid-demo-key-ops"
CANDIDATE = "full-v19"
VOCAB = 32_000  # the emulator's tokens: an answer outside 0..VOCAB-1 is invalid
# Issue 26's bad candidates: config parameters of the emulator (examples/orchid/emulator).
BAD_CANDIDATES = {
    "full-v19-slowlong": {"slow_long_input_tokens": "1024", "slow_long_scale": "4"},
    "full-v19-drift": {"invalid_output_after": "3", "invalid_output_every": "5"},
}


@dataclass
class Answer:
    sent: float
    latency_s: float
    status: str  # "OK" or the gRPC status
    version: str = ""
    reason: str = ""
    invalid: bool = False  # an answer whose tokens are outside the vocabulary
    late: bool = False  # DEADLINE_EXCEEDED after running (not the gateway's early refusal)


def write_config(work: Path, args: argparse.Namespace, port: int) -> Path:
    config = yaml.safe_load((EXAMPLE / "gateway.yaml").read_text())
    config["listen"] = f"127.0.0.1:{port}"
    config["tenants_file"] = str(EXAMPLE / "tenants.yaml")
    config["routes_dir"] = str(ROOT / "routes")
    config["policies_dir"] = str(ROOT / "policies")
    config["rollouts_dir"] = str(write_rollouts(work))
    local = config["local_triton"]
    # The example repository, with the candidate deployed at full size: as many instances
    # (devices) as full-v18, so that it may take the whole route when promoted.
    repository = work / "repo" / "model_repository"
    shutil.copytree(EXAMPLE / "model_repository", repository, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(
        EXAMPLE / "emulator", work / "repo" / "emulator", ignore=shutil.ignore_patterns("__pycache__")
    )
    candidate = repository / CANDIDATE / "config.pbtxt"
    candidate.write_text(
        candidate.read_text().replace("count: 1, kind: KIND_CPU", "count: 4, kind: KIND_CPU")
    )
    for name, params in BAD_CANDIDATES.items():
        shutil.copytree(
            repository / CANDIDATE, repository / name, ignore=shutil.ignore_patterns("__pycache__")
        )
        text = candidate.read_text().replace(f'name: "{CANDIDATE}"', f'name: "{name}"')
        extra = "".join(f'  {{ key: "{k}", value: {{ string_value: "{v}" }} }},\n' for k, v in params.items())
        (repository / name / "config.pbtxt").write_text(
            text.replace("parameters [\n", "parameters [\n" + extra)
        )
    local["model_repository"] = str(repository)
    local["time_factor"] = args.time_factor
    local["model_control"] = "explicit"
    local["load_models"] = ["full-v18", "compact-v11", "full-v18-kestrel", "full-v18-stream"]
    path = work / "gateway.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def write_rollouts(work: Path) -> Path:
    """The shipped rollout, and one copy of it per bad candidate (name, candidate, label)."""
    directory = work / "rollouts"
    directory.mkdir()
    shutil.copy(ROOT / "rollouts" / "full-v19.yaml", directory / "full-v19.yaml")
    data = yaml.safe_load((ROOT / "rollouts" / "full-v19.yaml").read_text())
    for name in BAD_CANDIDATES:
        bad = dict(data, name=name, candidate={"backend_model": name, "version": "1", "label": name})
        (directory / f"{name}.yaml").write_text(yaml.safe_dump(bad, sort_keys=False))
    return directory


async def one_request(
    client: aioclient.InferenceServerClient, t0: float, rng: random.Random, args: Any
) -> Answer:
    tenant = "orchid" if rng.random() < 0.5 else "lumen"
    tokens = 4096 if rng.random() < args.long_share else 256
    params: dict[str, Any] = {"orchid.max_output_tokens": 64}
    if tenant == "lumen" and rng.random() < 0.2:
        params["orchid.risk_class"] = "regulated"
    tensor = aioclient.InferInput("INPUT_IDS", [1, tokens], "INT32")
    tensor.set_data_from_numpy((np.arange(tokens, dtype=np.int32) % 1000).reshape(1, tokens))
    sent = time.monotonic()
    try:
        result = await client.infer(
            "full-v18",
            [tensor],
            headers={"authorization": f"Bearer {KEYS[tenant]}"},
            parameters=params,
            client_timeout=args.deadline_ms / 1000.0,
        )
    except InferenceServerException as exc:
        match = re.match(r"\[StatusCode\.(\w+)\]", str(exc))
        # The caller's own deadline ran out ("Deadline Exceeded"), or a backend call did
        # ("did not finish before the deadline"): an error, not an early refusal.
        late = "Deadline Exceeded" in str(exc) or "did not finish" in str(exc)
        answer = Answer(sent - t0, time.monotonic() - sent, match.group(1) if match else "ERROR", late=late)
        answer.reason = str(exc)[:120]  # the error, for the breakdown
        return answer
    p = result.get_response().parameters
    output = result.as_numpy("OUTPUT_IDS")
    valid = output is not None and output.size > 0 and int(output.min()) >= 0 and int(output.max()) < VOCAB
    return Answer(
        sent - t0,
        time.monotonic() - sent,
        "OK",
        p["orchid.model_version"].string_param,
        p["orchid.route_reason"].string_param,
        invalid=not valid,
    )


async def traffic(address: str, t0: float, stop: asyncio.Event, answers: list[Answer], args: Any) -> None:
    """Poisson arrivals at ``args.rate`` until ``stop`` is set, open loop."""
    rng = random.Random(args.seed)
    loop = asyncio.get_running_loop()

    def schedule() -> Iterator[float]:
        next_at = 0.0
        while not stop.is_set():
            next_at += rng.expovariate(args.rate)
            yield next_at

    async with aioclient.InferenceServerClient(address) as client:

        async def one(_: float) -> None:
            answers.append(await one_request(client, t0, rng, args))

        await send_open_loop(schedule(), one, t0=loop.time(), at=float)


async def status(address: str, name: str) -> tuple[str, dict[str, Any]]:
    reply = await asyncio.to_thread(rollout_call, address, ADMIN_KEY, "status", name)
    return reply.phase, json.loads(reply.report_json)


async def rehearse(
    address: str, faults: Path, t0: float, events: list[tuple[float, str]], args: Any
) -> list[Any]:
    """The seed's sequence; returns both rollout reports (with their start offsets)."""

    def mark(text: str) -> None:
        events.append((time.monotonic() - t0, text))

    reports: list[Any] = []
    # The candidate's quality evidence (the rollout's quality_score_drop guardrail reads it).
    await asyncio.to_thread(
        publish_evidence,
        address,
        ADMIN_KEY,
        model="full-v18",
        version="v19",
        population="orchid-text-eval-2026q3",
        score=0.91,
        samples=800,
        owner="rehearsal",
        max_age_s=86400.0,
    )
    mark("published full-v19's evaluation: 0.91 on orchid-text-eval-2026q3 (full-v18: 0.92)")
    await asyncio.sleep(args.baseline_s)
    # 1-3: load, warm, shadow, canary the high-risk cohorts; force an allocation failure.
    mark("rollout 1 started (peak traffic on full-v18)")
    started = time.monotonic() - t0
    await asyncio.to_thread(rollout_call, address, ADMIN_KEY, "start", "full-v19")
    forced = False
    while True:
        phase, report = await status(address, "full-v19")
        if phase == "canary" and not forced:
            (faults / f"{CANDIDATE}.fail_execute").write_text("0")
            forced = True
            mark("forced allocation failure on full-v19 (its next execution fails)")
        if phase in ("rolled_back", "aborted", "complete") and (
            report.get("unload_s") is not None or phase == "complete"
        ):
            break
        await asyncio.sleep(0.1)
    reports.append((started, report))
    (faults / f"{CANDIDATE}.fail_execute").unlink(missing_ok=True)
    await asyncio.sleep(args.between_s)
    # 4: the same rollout, fault cleared, to promotion and the old version's removal.
    mark("rollout 2 started (fault cleared)")
    started = time.monotonic() - t0
    await asyncio.to_thread(rollout_call, address, ADMIN_KEY, "start", "full-v19")
    while True:
        phase, report = await status(address, "full-v19")
        if phase in ("rolled_back", "aborted") and report.get("unload_s") is not None:
            break
        if phase == "complete":
            break
        await asyncio.sleep(0.1)
    reports.append((started, report))
    await asyncio.sleep(args.after_s)
    mark("traffic stops")
    return reports


async def bad_candidates(address: str, t0: float, events: list[tuple[float, str]], args: Any) -> list[Any]:
    """Issue 26's bad candidates, one rollout each; returns their reports (with start offsets)."""

    def mark(text: str) -> None:
        events.append((time.monotonic() - t0, text))

    reports: list[Any] = []
    await asyncio.sleep(args.baseline_s)
    for name in BAD_CANDIDATES:
        # As good an evaluation as the shipped candidate's (the quality guardrail passes).
        await asyncio.to_thread(
            publish_evidence,
            address,
            ADMIN_KEY,
            model="full-v18",
            version=name,
            population="orchid-text-eval-2026q3",
            score=0.91,
            samples=800,
            owner="rehearsal",
            max_age_s=86400.0,
        )
        mark(f"rollout {name} started")
        started = time.monotonic() - t0
        await asyncio.to_thread(rollout_call, address, ADMIN_KEY, "start", name)
        while True:
            phase, report = await status(address, name)
            if phase in ("rolled_back", "aborted") and report.get("unload_s") is not None:
                break
            if phase == "complete":
                break
            await asyncio.sleep(0.1)
        reports.append((started, report))
        await asyncio.sleep(args.between_s)
    mark("traffic stops")
    return reports


def attainment(answers: list[Answer], deadline_s: float) -> tuple[int, int, int, int, float]:
    admitted = [a for a in answers if a.status == "OK"]
    on_time = sum(1 for a in admitted if a.latency_s <= deadline_s)
    refused = sum(
        1 for a in answers if a.status in ("RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED") and not a.late
    )
    failed = len(answers) - len(admitted) - refused
    return len(answers), refused, failed, on_time, (on_time / len(admitted) * 100.0 if admitted else 100.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--rate",
        type=float,
        default=None,
        help="requests per second (Poisson; 120, or 136 with --bad-candidates)",
    )
    parser.add_argument(
        "--long-share",
        type=float,
        default=None,
        help="share of long requests (0.15, or 0.2 with --bad-candidates)",
    )
    parser.add_argument("--bad-candidates", action="store_true", help="issue 26's two bad candidates instead")
    parser.add_argument("--time-factor", type=float, default=0.1, help="the emulator's time factor")
    parser.add_argument("--deadline-ms", type=float, default=200.0, help="every request's gRPC deadline")
    parser.add_argument("--baseline-s", type=float, default=3.0, help="traffic before the rollout")
    parser.add_argument("--between-s", type=float, default=2.0, help="traffic between the two rollouts")
    parser.add_argument("--after-s", type=float, default=3.0, help="traffic after promotion")
    parser.add_argument("--seed", type=int, default=16)
    args = parser.parse_args(argv)
    if args.rate is None:
        args.rate = 136.0 if args.bad_candidates else 120.0
    if args.long_share is None:
        args.long_share = 0.2 if args.bad_candidates else 0.15
    work = Path(tempfile.mkdtemp(prefix="orchid-rehearsal-"))
    faults = work / "faults"
    faults.mkdir()
    port = free_port()
    config = write_config(work, args, port)
    # The gateway starts its own Triton (local_triton) and loads four models before it is ready.
    gateway = GatewayProcess(
        config,
        work,
        listen=f"127.0.0.1:{port}",
        env={"ORCHID_FAULT_DIR": str(faults)},
        ready_timeout_s=180.0,
        stop_timeout_s=30.0,
    )
    try:
        try:
            gateway.start()
        except RuntimeError as error:
            print(f"gateway did not start: {error}", file=sys.stderr)
            return 3
        address = gateway.address
        answers: list[Answer] = []
        events: list[tuple[float, str]] = []

        async def run() -> list[Any]:
            stop = asyncio.Event()
            t0 = time.monotonic()
            load = asyncio.create_task(traffic(address, t0, stop, answers, args))
            try:
                if args.bad_candidates:
                    return await bad_candidates(address, t0, events, args)
                return await rehearse(address, faults, t0, events, args)
            finally:
                stop.set()
                await load

        reports = asyncio.run(run())
    finally:
        gateway.stop()
    ok = print_results(answers, events, reports, args)
    shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


def print_results(
    answers: list[Answer], events: list[tuple[float, str]], reports: list[Any], args: Any
) -> bool:
    """Print the run; with ``--bad-candidates``, whether every scenario passed."""
    timeline = list(events)
    for number, (started, report) in enumerate(reports, 1):
        for at, text in report["timeline"]:
            timeline.append((started + at, f"[rollout {number}] {text}"))
    timeline.sort()
    # The mix's mean price (routes/orchid.yaml's full-v18 profile: 56.8 ms short, 440.8 ms long
    # at 64 output tokens) against the protected envelope of full-v18's 4 devices at 70 %.
    offered = args.rate * ((1 - args.long_share) * 56.8 + args.long_share * 440.8) * args.time_factor
    print(
        f"Rehearsal: {args.rate:g} req/s, time factor {args.time_factor:g}, deadline {args.deadline_ms:g} ms;"
        f" offered {offered:.0f} device-ms/s = {offered / (4 * 700.0):.0%} of full-v18's protected envelope"
    )
    print("\nTimeline (s since traffic start)")
    for at, text in timeline:
        print(f"  {at:7.2f}  {text}")
    # Phases: cut the run at the rollout events.
    cuts = [(0.0, "baseline (full-v18 serves)")]
    for number, (started, report) in enumerate(reports, 1):
        rel = {text.split(":")[0]: started + at for at, text in report["timeline"]}
        ready = report.get("ready_at_s")
        cuts.append((started, f"rollout {number}: load + warm-up"))
        if ready is not None:
            cuts.append((started + ready, f"rollout {number}: shadow/canary"))
        for key in ("rolled back", "promoted (all steps passed)"):
            if key in rel:
                cuts.append(
                    (
                        rel[key],
                        f"rollout {number}: "
                        + ("routed back, drain" if "rolled" in key else "promoted, old drains"),
                    )
                )
        for at, text in report["timeline"]:
            if text.startswith("retired version unloaded"):
                cuts.append((started + at, f"rollout {number}: after unload"))
    cuts.sort()
    head = ("from s", 7), ("requests", 9), ("refused", 8), ("failed", 7), ("on time", 8), ("attain %", 9)
    print(f"\n{'phase':40s} " + " ".join(f"{name:>{width}s}" for name, width in head))
    deadline_s = args.deadline_ms / 1000.0
    for index, (start, name) in enumerate(cuts):
        end = cuts[index + 1][0] if index + 1 < len(cuts) else float("inf")
        window = [a for a in answers if start <= a.sent < end]
        if not window:
            continue
        n, refused, failed, on_time, pct = attainment(window, deadline_s)
        print(f"{name:40s} {start:7.2f} {n:9d} {refused:8d} {failed:7d} {on_time:8d} {pct:9.2f}")
    n, refused, failed, on_time, pct = attainment(answers, deadline_s)
    print(f"{'whole run':40s} {0.0:7.2f} {n:9d} {refused:8d} {failed:7d} {on_time:8d} {pct:9.2f}")
    versions: dict[str, int] = {}
    for a in answers:
        if a.status == "OK":
            key = f"{a.version} ({a.reason})"
            versions[key] = versions.get(key, 0) + 1
    print(
        "\nAnswers by version (route reason): " + ", ".join(f"{k}: {v}" for k, v in sorted(versions.items()))
    )
    errors: dict[str, int] = {}
    for a in answers:
        if a.status != "OK" and (a.late or a.status not in ("RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED")):
            key = re.sub(r"[0-9.]+", "N", a.reason)
            errors[key] = errors.get(key, 0) + 1
    for text, count in sorted(errors.items(), key=lambda kv: -kv[1])[:5]:
        print(f"  caller error x{count}: {text}")
    invalid = sum(1 for a in answers if a.status == "OK" and a.invalid)
    print(f"Invalid answers seen by callers (tokens outside 0..{VOCAB - 1}): {invalid}")
    for number, (_, report) in enumerate(reports, 1):
        print(
            f"rollout {number} ({report['name']}): {report['phase']} "
            f"at step {report['step']}/{report['steps']}"
            + (f" ({report['reason']})" if report["reason"] else "")
            + f"; load {report['load_s']} s, warm-up {report['warm_s']} s, retired version safe to remove "
            f"{report['safe_to_remove_after_s']} s after the switch, unload {report['unload_s']} s, "
            f"candidate memory high-water {report['memory_high_water']:.1%}; canaries {report['diverted']}, "
            f"hedged {report['hedged'] or 0} holding {report['hedge_device_ms']:.1f} device-ms, "
            f"{report['hedge_unanswered']} of them unanswered "
            f"(the rollout's cost, at time factor {args.time_factor:g})"
        )
    if not args.bad_candidates:
        return True
    passed = True
    print(
        "\nBad-candidate scenarios (issue 26): rolled back, no hedged canary unanswered, no invalid "
        "answer, >= 95 % on time"
    )
    for index, (started, report) in enumerate(reports):
        end = reports[index + 1][0] if index + 1 < len(reports) else float("inf")
        window = [a for a in answers if started <= a.sent < end]
        n, refused, failed, on_time, pct = attainment(window, deadline_s)
        errors = failed
        bad = sum(1 for a in window if a.status == "OK" and a.invalid)
        # The candidate's own cost to callers: hedged canaries the current version did not
        # answer either (the gateway's count). Caller errors are the client's ruler; on a busy
        # 2-core machine the loads of Triton's Python stubs cost some of them in any phase
        # (the per-phase table says where).
        ok = report["phase"] == "rolled_back" and report["hedge_unanswered"] == 0 and bad == 0 and pct >= 95.0
        passed = passed and ok
        print(
            f"  {report['name']}: {'PASS' if ok else 'FAIL'}: {report['phase']} at step {report['step']}; "
            f"{n} requests, {errors} caller errors (a deadline run out included), {refused} refused early, "
            f"{bad} invalid answers, {report['hedge_unanswered']} hedged canaries unanswered, "
            f"{pct:.2f} % of admitted work on time"
        )
    return passed


if __name__ == "__main__":
    sys.exit(main())
