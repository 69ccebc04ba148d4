"""Upstream feature contracts against a real Feast feature server (``tests.feast_server``) and the
session Triton's ``ranker-v3`` (which echoes the FEATURES input it received as FEATURES_SEEN),
called with unmodified ``tritonclient``.

The example route ``ranker`` reads ``ranker_v12`` (score, clicks, risk) for the request's
``user_id``; the example repository's data: user 1's latest values are 1 h old (score 11,
clicks 101, risk 1/64), user 7's only row is 3 days old, user 8 has none.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml
from tritonclient.utils import InferenceServerException

from gateway.backends.local import LocalTriton
from gateway.config import FeatureSourceConfig, GatewayConfig, load_routes
from gateway.core.errors import ConfigError
from gateway.features import check_contracts
from gateway.features.registry import _REGISTRY
from orchid_tools.featurestore import FeastServer
from tests.conftest import LUMEN_KEY, ORCHID_KEY, ROOT, ThreadedGateway, gateway_config

ROUTES = ROOT / "routes"


def source(feast: FeastServer, registry: Path, **changes: Any) -> FeatureSourceConfig:
    return FeatureSourceConfig(url=feast.url, registry=registry, **changes)


def routes_with(tmp_path: Path, **contract: Any) -> Path:
    """The example routes with the ranker contract's fields replaced (features by ref)."""
    data = yaml.safe_load((ROUTES / "orchid.yaml").read_text())
    features = data["models"]["ranker"]["features"]
    overrides = contract.pop("feature_overrides", {})
    features["features"] = [dict(f, **overrides.get(f["ref"], {})) for f in features["features"]]
    features.update(contract)
    directory = tmp_path / "routes"
    directory.mkdir()
    (directory / "orchid.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return directory


@pytest.fixture
def registry(feast_server: FeastServer, tmp_path: Path) -> Path:
    """A copy of the server's registry the test may rewrite (the gateway reads this one)."""
    copy = tmp_path / "registry.db"
    shutil.copy(feast_server.registry_path, copy)
    return copy


def start(config: GatewayConfig) -> ThreadedGateway:
    running = ThreadedGateway(config)
    running.start()
    return running


@pytest.fixture
def served(triton: LocalTriton, feast_server: FeastServer, registry: Path) -> Iterator[ThreadedGateway]:
    running = start(gateway_config(triton.address, feature_sources={"feast": source(feast_server, registry)}))
    try:
        yield running
    finally:
        running.stop()


def ask(
    gateway: ThreadedGateway, user: int | str, *, key: str = ORCHID_KEY, **inputs: np.ndarray
) -> grpcclient.InferResult:
    client = grpcclient.InferenceServerClient(gateway.address)
    try:
        tensors = []
        for name, array in {"INPUT_IDS": np.arange(16, dtype=np.int32).reshape(1, 16), **inputs}.items():
            tensor = grpcclient.InferInput(
                name, list(array.shape), "INT32" if array.dtype == np.int32 else "FP32"
            )
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        return client.infer(
            "ranker", tensors, parameters={"user_id": user}, headers={"authorization": f"Bearer {key}"}
        )
    finally:
        client.close()


def refusal(gateway: ThreadedGateway, user: int | str, **kwargs: Any) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        ask(gateway, user, **kwargs)
    return caught.value


def parameters(result: grpcclient.InferResult) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in result.get_response().parameters.items():
        out[key] = getattr(value, value.WhichOneof("parameter_choice"))
    return out


def iso(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat().replace("+00:00", "Z")


def test_a_request_gets_its_features_as_the_model_input_with_the_snapshot_in_provenance(
    served: ThreadedGateway, feast_server: FeastServer
) -> None:
    result = ask(served, 1)
    assert result.as_numpy("FEATURES_SEEN").tolist() == [[11.0, 101.0, 0.015625]]
    provenance = parameters(result)
    assert provenance["orchid.feature_snapshot"] == f"v12@{iso(feast_server.now - timedelta(hours=1))}"
    assert provenance["orchid.feature_cached"] is False
    assert "orchid.features_defaulted" not in provenance
    # Several users in one read (one batched call), in the order asked.
    several = ask(served, "2,1")
    assert several.as_numpy("FEATURES_SEEN").tolist() == [[21.0, 201.0, 0.03125, 11.0, 101.0, 0.015625]]


def test_a_caller_cannot_send_the_features_itself_and_must_name_its_entities(served: ThreadedGateway) -> None:
    forged = refusal(served, 1, FEATURES=np.zeros((1, 3), dtype=np.float32))
    assert forged.status() == "StatusCode.INVALID_ARGUMENT" and "FEATURES" in str(forged.message())
    too_many = refusal(served, ",".join(str(u) for u in range(1, 18)))
    assert too_many.status() == "StatusCode.INVALID_ARGUMENT" and "1 to 16" in str(too_many.message())


def test_values_older_than_their_maximum_age_or_missing_follow_the_contract(
    triton: LocalTriton, feast_server: FeastServer, registry: Path, tmp_path: Path
) -> None:
    # The example contract: score refuses past 6 h; user 7's values are 3 days old.
    with_example = start(
        gateway_config(triton.address, feature_sources={"feast": source(feast_server, registry)})
    )
    try:
        stale = refusal(with_example, 7)
        assert stale.status() == "StatusCode.FAILED_PRECONDITION"
        assert "user_stats_v12:score" in str(stale.message()) and "old" in str(stale.message())
        missing = refusal(with_example, 8)  # no values at all: score refuses
        assert missing.status() == "StatusCode.FAILED_PRECONDITION" and "NOT_FOUND" in str(missing.message())
    finally:
        with_example.stop()
    # Defaults instead: every stale or missing value replaced, and the answer says which.
    routes = routes_with(
        tmp_path,
        feature_overrides={
            "user_stats_v12:score": {"missing": "default", "default": -1.0},
            "user_stats_v12:risk": {"missing": "default", "default": 0.5, "max_age_s": 7200},
        },
    )
    defaulting = start(
        gateway_config(
            triton.address, routes_dir=routes, feature_sources={"feast": source(feast_server, registry)}
        )
    )
    try:
        result = ask(defaulting, 7)
        assert result.as_numpy("FEATURES_SEEN").tolist() == [[-1.0, 0.0, 0.5]]
        assert parameters(result)["orchid.features_defaulted"] == (
            "user_stats_v12__score,user_stats_v12__clicks,user_stats_v12__risk"
        )
        fresh = ask(defaulting, 1)  # 1 h old: within every maximum age
        assert fresh.as_numpy("FEATURES_SEEN").tolist() == [[11.0, 101.0, 0.015625]]
        assert "orchid.features_defaulted" not in parameters(fresh)
    finally:
        defaulting.stop()


def retag(registry: Path, service: str, version: str) -> None:
    """Rewrite the registry file as if the feature repository re-tagged ``service`` (and its
    views) with another definition version: Feast's bytes, with only the tags changed."""
    parsed = _REGISTRY()
    parsed.ParseFromString(registry.read_bytes())
    for entry in parsed.feature_services:
        if entry.spec.name == service:
            entry.spec.tags["definition_version"] = version
            views = {p.feature_view_name for p in entry.spec.features}
    for view in parsed.feature_views:
        if view.spec.name in views:
            view.spec.tags["definition_version"] = version
    registry.write_bytes(parsed.SerializeToString())


def test_an_incompatible_definition_version_is_refused_at_load_and_at_request_time(
    triton: LocalTriton, feast_server: FeastServer, registry: Path, tmp_path: Path
) -> None:
    # At load: a route trained on v13 against ranker_v12 (v12 in the registry).
    config = gateway_config(
        triton.address,
        routes_dir=routes_with(tmp_path, definition_version="v13"),
        feature_sources={"feast": source(feast_server, registry)},
    )
    with pytest.raises(ConfigError) as caught:
        check_contracts(config, load_routes(config.routes_dir))
    located = str(caught.value)
    assert "orchid.yaml:" in located and "features.definition_version" in located
    assert "definition v12, the model was trained on v13" in located

    # At request time: the source's ranker_v12 becomes v13 while the gateway runs on v12.
    running = start(gateway_config(triton.address, feature_sources={"feast": source(feast_server, registry)}))
    try:
        assert ask(running, 1).as_numpy("FEATURES_SEEN").tolist() == [[11.0, 101.0, 0.015625]]
        retag(registry, "ranker_v12", "v13")
        refused = None
        for _ in range(100):  # the registry is re-read when it changes, at most once a second
            try:
                ask(running, 2)
            except InferenceServerException as error:
                refused = error
                break
            running.call(_pause(0.05))
        assert refused is not None, "a v13 source still served the v12 model"
        assert refused.status() == "StatusCode.FAILED_PRECONDITION"
        assert "definition v13, the model was trained on v12" in str(refused.message())
    finally:
        running.stop()


async def _pause(seconds: float) -> None:
    import asyncio

    await asyncio.sleep(seconds)


@pytest.fixture
def lumen_too(
    triton: LocalTriton, feast_server: FeastServer, registry: Path, tmp_path: Path
) -> Iterator[ThreadedGateway]:
    """The example stack with lumen allowed the ranker route too (the shipped tenants give it
    to orchid only)."""
    tenants = yaml.safe_load((ROOT / "examples" / "orchid" / "tenants.yaml").read_text())
    tenants["tenants"]["lumen"]["models"] = [*tenants["tenants"]["lumen"]["models"], "ranker"]
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump(tenants))
    running = start(
        gateway_config(
            triton.address, tenants_file=path, feature_sources={"feast": source(feast_server, registry)}
        )
    )
    try:
        yield running
    finally:
        running.stop()


def test_the_cache_never_crosses_tenants(lumen_too: ThreadedGateway) -> None:
    served = lumen_too
    first = ask(served, 3)
    assert parameters(first)["orchid.feature_cached"] is False
    again = ask(served, 3)
    assert parameters(again)["orchid.feature_cached"] is True
    # lumen asks for the same user: orchid's entry is not lumen's.
    other = ask(served, 3, key=LUMEN_KEY)
    assert parameters(other)["orchid.feature_cached"] is False
    assert other.as_numpy("FEATURES_SEEN").tolist() == first.as_numpy("FEATURES_SEEN").tolist()
    assert parameters(ask(served, 3, key=LUMEN_KEY))["orchid.feature_cached"] is True
    # Operators see the hit rate and the values' age on /metrics.
    assert served.server.telemetry is not None
    registry = served.server.telemetry.metrics.registry
    hits = registry.get_sample_value("orchid_feature_cache_hits_total", {"source": "feast"})
    misses = registry.get_sample_value("orchid_feature_cache_misses_total", {"source": "feast"})
    assert hits is not None and misses is not None and hits >= 2 and misses >= 2
    within_a_day = registry.get_sample_value(
        "orchid_feature_value_age_seconds_bucket", {"source": "feast", "le": "86400"}
    )
    assert within_a_day is not None and within_a_day >= 4
