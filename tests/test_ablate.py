"""``bench/ablate.py`` (the ablation diagnostic of ``bench/overhead.py --ablate``) still takes out
what it names, and the gateway it leaves still answers.

It patches the runtime by name (``PolicyStore.evaluate``, the listener group, the chain's
``attach_provenance``, ``Gateway.infer``), so a change of one of those signatures broke it
silently once: ``--ablate policy`` answered every call INTERNAL after ``evaluate`` gained its
``snapshot`` argument. Each case runs in its own interpreter (the patches are global) the
example stack in process on ``MemoryBackend``, as ``bench/request_path.py`` builds it, and
checks the part is gone and the answers are still right.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import asyncio, json, sys
sys.path.insert(0, sys.argv[1] + "/bench")
import ablate, request_path
from gateway import clock
from gateway.exchange import CallContext
from gateway.policy.metrics import POLICY_EVAL_SECONDS
from tritonclient.grpc import service_pb2

parts = set(filter(None, sys.argv[2].split(",")))
if parts:
    ablate.ablate(parts)


def evaluations() -> float:
    return sum(s.value for m in POLICY_EVAL_SECONDS.collect() for s in m.samples if s.name.endswith("_count"))


async def main() -> None:
    gateway, raw, metadata = await request_path.build()
    board = gateway.listener.listeners[1]
    before = evaluations()
    answers = []
    for _ in range(3):
        answer = await gateway.infer(
            raw, CallContext(metadata=metadata, time_remaining_s=None, received_at=clock.now())
        )
        response = service_pb2.ModelInferResponse.FromString(answer.SerializeToString())
        answers.append(
            {
                "model": response.model_name,
                "outputs": [o.name for o in response.outputs],
                "provenance": sorted(k for k in response.parameters if k.startswith("orchid.")),
            }
        )
    print(json.dumps({
        "answers": answers,
        "evaluations": evaluations() - before,
        "board_decisions": len(board.snapshot()["decisions"]),
    }))


asyncio.run(main())
"""


def _run(parts: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(REPO), parts],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture(scope="module")
def whole() -> dict[str, object]:
    return _run("")


def test_the_whole_gateway_evaluates_reports_and_stamps_every_answer(whole: dict[str, object]) -> None:
    answers = whole["answers"]
    assert isinstance(answers, list)
    assert all(a["model"] == "full-v18" and a["outputs"] and a["provenance"] for a in answers)
    assert whole["evaluations"] == 3
    assert whole["board_decisions"] == 3


@pytest.mark.parametrize(
    ("parts", "gone"),
    [
        ("policy", "evaluations"),
        ("telemetry", "board_decisions"),
        ("provenance", "provenance"),
        ("decisions", "everything"),
        ("policy,telemetry,provenance", "all three"),
    ],
)
def test_each_ablation_takes_out_its_part_and_still_answers(
    parts: str, gone: str, whole: dict[str, object]
) -> None:
    result = _run(parts)
    answers = result["answers"]
    assert isinstance(answers, list) and len(answers) == 3
    assert all(a["model"] == "full-v18" and a["outputs"] for a in answers), answers
    stamped = all(a["provenance"] for a in answers)
    if "policy" in parts:
        assert result["evaluations"] == 1  # the first answer, then reused
    if "telemetry" in parts or parts == "decisions":
        assert result["board_decisions"] == 0
    if "provenance" in parts or parts == "decisions":
        assert not stamped
    else:
        assert stamped
    if parts == "decisions":
        assert result["evaluations"] == 0
    if parts == "telemetry":  # everything else stays
        assert result["evaluations"] == whole["evaluations"]
