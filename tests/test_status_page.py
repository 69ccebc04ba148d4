"""The status page over HTTP: access (admin only), privacy (no payload), data that agrees
with the metrics endpoint, and the board's bounded histories. The browser test is
``tests/test_status_browser.py``."""

from __future__ import annotations

import http.client
import json
import re
from collections.abc import Iterator
from types import SimpleNamespace

import grpc
import pytest
from tritonclient.grpc import service_pb2_grpc

from gateway import clock
from gateway.backends.local import LocalTriton
from gateway.config import TelemetryConfig
from gateway.statusboard import RECENT_DECISIONS, StatusBoard
from gateway.statuspage import TelemetryListener
from tests.conftest import LUMEN_KEY, OPS_KEY, ORCHID_KEY, ThreadedGateway, gateway_config
from tests.test_telemetry import CANARY, planted

ADMIN_ONLY = ("/status", "/status.json")


@pytest.fixture(scope="module")
def served(triton: LocalTriton) -> Iterator[ThreadedGateway]:
    config = gateway_config(
        triton.address, telemetry=TelemetryConfig(metrics_listen="127.0.0.1:0", tenant_labels=True)
    )
    running = ThreadedGateway(config)
    running.start()
    try:
        yield running
    finally:
        running.stop()


def listener(running: ThreadedGateway) -> TelemetryListener:
    served = running.server.telemetry_listener
    assert served is not None
    return served


def get(
    running: ThreadedGateway, path: str, *headers: tuple[str, str], method: str = "GET"
) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", listener(running).port, timeout=10)
    try:
        connection.putrequest(method, path)
        for name, value in headers:
            connection.putheader(name, value)
        connection.endheaders()
        reply = connection.getresponse()
        return reply.status, {k.lower(): v for k, v in reply.getheaders()}, reply.read()
    finally:
        connection.close()


def bearer(key: str) -> tuple[str, str]:
    return ("Authorization", f"Bearer {key}")


def test_binds_localhost_by_default() -> None:
    board = StatusBoard()
    assert TelemetryListener(None, None, board, listen=":9464").host == "127.0.0.1"  # type: ignore[arg-type]


@pytest.mark.parametrize("path", ADMIN_ONLY)
def test_no_credential_is_refused(served: ThreadedGateway, path: str) -> None:
    status, headers, body = get(served, path)
    assert status == 401
    assert headers["www-authenticate"].startswith("Bearer")
    if path == "/status":  # the sign-in form, and no data
        assert b'id="signin-form"' in body and b"full-v18" not in body
    else:
        assert b"missing credential" in body


@pytest.mark.parametrize("path", ADMIN_ONLY)
@pytest.mark.parametrize("key", [ORCHID_KEY, LUMEN_KEY])
def test_non_admin_key_is_refused(served: ThreadedGateway, path: str, key: str) -> None:
    status, _, body = get(served, path, bearer(key))
    assert status == 403
    assert b"admin credential" in body and b"tenants" not in body


@pytest.mark.parametrize("path", ADMIN_ONLY)
def test_unknown_or_doubled_credential_is_refused(served: ThreadedGateway, path: str) -> None:
    assert get(served, path, bearer("not-a-key"))[0] == 401
    # Two headers: one admin, one not. Refused, as on gRPC (a proxy may have checked the other).
    assert get(served, path, bearer(OPS_KEY), bearer(ORCHID_KEY))[0] == 401


def test_admin_gets_page_and_data(served: ThreadedGateway) -> None:
    status, headers, body = get(served, "/status", bearer(OPS_KEY))
    assert status == 200 and b"/status.js" in body
    assert "script-src 'self'" in headers["content-security-policy"]
    status, headers, body = get(served, "/status.json", bearer(OPS_KEY))
    assert status == 200 and headers["content-type"] == "application/json"
    assert headers["cache-control"] == "no-store"
    data = json.loads(body)
    assert {"pools", "tenants", "policy", "decisions", "backends", "refusals"} <= data.keys()
    assert data["policy"]["ready"] and data["policy"]["last_reload"]["outcome"] == "ok"
    assert [b["name"] for b in data["backends"]] == ["local"] and data["backends"][0]["healthy"]
    # The assets ship in the package and carry no data.
    for asset, kind in (("/status.js", "javascript"), ("/status.css", "css")):
        status, headers, body = get(served, asset)
        assert status == 200 and kind in headers["content-type"] and len(body) > 500


def test_metrics_and_methods(served: ThreadedGateway) -> None:
    status, headers, body = get(served, "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert b'orchid_backend_ready{backend="local"} 1.0' in body
    openmetrics = get(served, "/metrics", ("Accept", "application/openmetrics-text; version=1.0.0"))
    assert openmetrics[1]["content-type"].startswith("application/openmetrics-text")
    assert openmetrics[2].rstrip().endswith(b"# EOF")
    assert get(served, "/status.json", bearer(OPS_KEY), method="POST")[0] == 405
    assert get(served, "/nothing-here")[0] == 404


def test_canary_payload_never_reaches_page_or_data(served: ThreadedGateway) -> None:
    metadata = (("authorization", f"Bearer {ORCHID_KEY}"), ("x-user", CANARY))
    with grpc.insecure_channel(served.address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        assert stub.ModelInfer(planted(), metadata=metadata, timeout=10).model_name == "full-v18"
        for request, meta in (
            (planted(**{"orchid.class": CANARY}), metadata),
            (planted(n=9000), metadata),
            (planted(), (("authorization", f"Bearer {CANARY}"),)),
        ):
            with pytest.raises(grpc.RpcError):
                stub.ModelInfer(request, metadata=meta, timeout=10)
    status, _, data = get(served, "/status.json", bearer(OPS_KEY))
    assert status == 200
    snapshot = json.loads(data)
    # The planted request is on the board (so this test can fail), without its payload.
    assert any(d["tenant"] == "orchid" and d["verdict"] == "admit" for d in snapshot["decisions"])
    assert {tuple(sorted(d)) for d in snapshot["decisions"]} == {
        ("at", "class", "ladder_step", "model", "route_reason", "rule", "target", "tenant", "verdict")
    }
    page = get(served, "/status", bearer(OPS_KEY))[2] + get(served, "/status.js")[2]
    for sink in (data, page):
        assert CANARY.encode() not in sink
        assert CANARY[:12].encode() not in sink


def metric_sum(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"{name}\{{(.*)\}} (\S+)$", line)
        if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            total += float(match.group(2))
    return total


def test_data_agrees_with_metrics(served: ThreadedGateway) -> None:
    with grpc.insecure_channel(served.address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(5):
            stub.ModelInfer(planted(), metadata=(("authorization", f"Bearer {LUMEN_KEY}"),), timeout=10)

    # The pool's first evidence comes with a ladder update: run one now, on the loop.
    gateway = served.server.gateway
    assert gateway is not None
    served.call_soon(lambda: gateway.update_ladders(clock.now()))

    def both() -> tuple[dict[str, object], str]:
        # One consistent read: the page's data and the scrape, on the gateway's loop.
        server = served.server
        assert server.telemetry_listener is not None
        from prometheus_client import generate_latest

        return served.call_soon(
            lambda: (
                server.status_board.snapshot(),
                generate_latest(server.telemetry.metrics.registry).decode(),
            )
        )

    data, metrics = both()
    lumen = next(t for t in data["tenants"] if t["name"] == "lumen")  # type: ignore[index]
    assert lumen["charged_ms"] > 0
    assert lumen["charged_ms"] == pytest.approx(
        metric_sum(metrics, "orchid_charged_accelerator_ms_total", tenant="lumen"), abs=1e-3
    )
    pool = next(p for p in data["pools"] if p["name"] == "local/full-v18")  # type: ignore[index]
    assert pool["step"] == metric_sum(metrics, "orchid_ladder_step", pool="local/full-v18")
    assert pool["offered_ms_per_s"] == pytest.approx(
        metric_sum(metrics, "orchid_pool_offered_accelerator_ms_per_second", pool="local/full-v18"), abs=1e-3
    )
    assert pool["protected_ms_per_s"] == metric_sum(
        metrics, "orchid_pool_protected_accelerator_ms_per_second", pool="local/full-v18"
    )
    assert pool["protected_ms_per_s"] > 0


# --------------------------------------------------------------------------- the board alone


def _fake_gateway(reason: list[str]) -> SimpleNamespace:
    evidence = SimpleNamespace(offered_ms_per_s=120.0, protected_capacity_ms_per_s=100.0)
    load = SimpleNamespace(evidence=evidence, ladder=SimpleNamespace(state=SimpleNamespace(reason=reason[0])))
    policy = SimpleNamespace(version="v1", failures=0, snapshot=None, last_diagnostics=())
    return SimpleNamespace(loads={"b/m": load}, policy=policy)


def test_board_keeps_step_changes_with_their_evidence() -> None:
    now = [1000.0]
    board = StatusBoard(wall=lambda: now[0])
    reason = ["offered 120.0 ms/s = 120.0% of protected 100.0 ms/s; climb 0 -> 3"]
    gateway = _fake_gateway(reason)
    board.gateway = gateway  # type: ignore[assignment]
    board.ladder("b/m", 3)
    now[0] += 0.5
    board.ladder("b/m", 3)  # no change: no entry, and no second sample within a second
    now[0] += 1.0
    gateway.loads["b/m"].ladder.state.reason = "...; descend 3 -> 1"
    board.ladder("b/m", 1)
    history = board._pools["b/m"]
    assert [(s["from"], s["to"]) for s in history.steps] == [(3, 1), (0, 3)]  # newest first
    assert "climb 0 -> 3" in history.steps[1]["evidence"]
    assert [s[3] for s in history.samples] == [3, 1]
    assert history.samples[0][1:3] == (120.0, 100.0)


def test_board_rings_are_bounded() -> None:
    board = StatusBoard()
    record = SimpleNamespace(
        identity=SimpleNamespace(tenant="t", request_class="c", model="m"), ladder_step=0
    )
    from gateway.core.record import Decision, Verdict

    decision = Decision(verdict=Verdict.REJECT, target_model="m", route_reason="", rules=("quota.x",))
    policy = SimpleNamespace(fail_open=(SimpleNamespace(rule="r"),))
    for _ in range(RECENT_DECISIONS + 7):
        board.decided(record, decision, policy)  # type: ignore[arg-type]
    assert len(board.decisions) == RECENT_DECISIONS
    assert board._rejections["t"]["quota.x"] == RECENT_DECISIONS + 7
    assert board._fail_opens["r"] == RECENT_DECISIONS + 7
