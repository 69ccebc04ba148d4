"""A request is diverted only to a fallback whose limits take it, against the real Triton.

The example's fallback (``compact-v11``) is given a smaller context window here (512 input
tokens) than its primary (``full-v18``, 8192). With the primary's ladder pinned at step 3
over its envelope, eligible work is diverted to the warm fallback; a 768-token request is
never sent there (Triton's own statistics for ``compact-v11`` count no inference), it is
answered by the primary, and its decision says why. A 256-token request, which the
fallback takes, is diverted as before: the same setup does send work there.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest
import tritonclient.grpc as grpcclient
import yaml
from tritonclient.grpc import service_pb2_grpc

from gateway.backends.local import LocalTriton
from gateway.core.record import Decision, RequestRecord
from gateway.policy.snapshot import PolicyResult
from tests.conftest import ROOT, ThreadedGateway, gateway_config, pinned_gateway
from tests.test_ladder_effects import AUTH, pin
from tests.test_ladder_effects import request as model_infer_request

FALLBACK_WINDOW = 512


@pytest.fixture(scope="module")
def narrow(triton: LocalTriton, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedGateway]:
    routes = yaml.safe_load((ROOT / "routes" / "orchid.yaml").read_text())
    compact = routes["models"]["compact-v11"]
    compact["shape"] = {**compact["shape"], "max_input_tokens": FALLBACK_WINDOW}  # its own copy
    directory = tmp_path_factory.mktemp("routes")
    (directory / "orchid.yaml").write_text(yaml.safe_dump(routes))
    yield from pinned_gateway(gateway_config(triton.address, routes_dir=directory))


def compact_inferences(triton: LocalTriton) -> int:
    client = grpcclient.InferenceServerClient(triton.address)
    try:
        stats = client.get_inference_statistics("compact-v11")
        return int(stats.model_stats[0].inference_stats.success.count)
    finally:
        client.close()


def answers(stub: service_pb2_grpc.GRPCInferenceServiceStub, n: int, tokens: int) -> Counter[str]:
    seen: Counter[str] = Counter()
    for _ in range(n):
        try:
            reply = stub.ModelInfer(
                model_infer_request(tokens, **{"orchid.max_output_tokens": 16}), metadata=AUTH, timeout=10
            )
            seen[f"ok:{reply.parameters['orchid.approximation'].string_param}"] += 1
        except grpc.RpcError as error:
            seen[f"{error.code().name}:{error.details()}"] += 1
    return seen


def test_a_request_too_long_for_the_fallback_is_never_sent_there(
    narrow: ThreadedGateway,
    triton: LocalTriton,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    core = narrow.server.gateway
    assert core is not None
    decisions: list[Decision] = []
    original = core.listener.decided

    def decided(record: RequestRecord, decision: Decision, policy: PolicyResult) -> None:
        decisions.append(decision)
        original(record, decision, policy)

    monkeypatch.setattr(core.listener, "decided", decided)
    log_lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda entry: log_lines.append(entry.getMessage())  # type: ignore[method-assign]
    decisions_log = logging.getLogger("orchid.decisions")
    monkeypatch.setattr(decisions_log, "handlers", [*decisions_log.handlers, handler])
    level = decisions_log.level
    decisions_log.setLevel(logging.INFO)  # setLevel: the logger caches isEnabledFor
    request.addfinalizer(lambda: decisions_log.setLevel(level))
    with grpc.insecure_channel(narrow.address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        assert answers(stub, 1, 256) == Counter({"ok:none": 1})  # creates the pool's load
        pin(narrow, 3, 1.5)  # step 3, half again the envelope: eligible work is diverted

        before = compact_inferences(triton)
        decisions.clear()
        too_long = answers(stub, 16, FALLBACK_WINDOW + 256)
        assert too_long == Counter({"ok:none": 16}), too_long
        assert compact_inferences(triton) == before  # Triton never saw one on the fallback
        refused = [d.fallback_refused for d in decisions]
        # Some were part of the diverted share; each of those says why it stayed.
        assert any(refused), refused
        assert set(refused) <= {"", "768 input tokens exceed the fallback 'compact-v11''s limit of 512"}
        assert any('"fallback_refused":"768 input tokens exceed' in line for line in log_lines)

        fits = answers(stub, 16, 256)  # the control: the fallback takes these, and is sent some
        assert fits["ok:fallback"] > 0 and fits["ok:fallback"] + fits["ok:none"] == 16, fits
        assert compact_inferences(triton) == before + fits["ok:fallback"]
