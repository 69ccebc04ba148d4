"""Output contracts (``gateway.core.outputs``, ``gateway.outputs``): the one definition of a
valid answer, declared on a route (every production answer checked before it is returned)
and on a rollout (a candidate's answers); the route's against a real Triton."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from gateway.backends.local import LocalTriton
from gateway.config import RouteConfig, load_routes
from gateway.core.outputs import OutputCheck, OutputFacts, output_problems
from gateway.outputs import INVALID_OUTPUTS, check_outputs, check_result, output_facts
from tests.conftest import ORCHID_KEY, ROOT, ThreadedGateway, bearer, gateway_config

CHECKS = {
    "OUTPUT_IDS": OutputCheck(
        datatype="INT32", shape=("items", "output_tokens"), min_value=0, max_value=31999
    )
}


def facts(shape: tuple[int, ...], low: float, high: float, *, datatype: str = "INT32") -> list[OutputFacts]:
    count = int(np.prod(shape))
    return [OutputFacts("OUTPUT_IDS", datatype, shape, count, low, high)]


def judge(found: list[OutputFacts], *, batched: bool = True) -> list[str]:
    return output_problems(found, CHECKS, items=1, input_tokens=8, output_tokens=4, batched=batched)


def test_output_problems_name_the_output_and_the_bound_never_the_values() -> None:
    assert judge(facts((1, 4), 0, 31999)) == []
    assert judge(facts((4,), 0, 31999), batched=False) == []  # no batch dimension: items dropped
    assert judge(facts((1, 3), 0, 5)) == ["output OUTPUT_IDS has shape [1, 3], expected [1, 4]"]
    assert judge(facts((1, 4), 0, 5, datatype="FP32")) == ["output OUTPUT_IDS is FP32, expected INT32"]
    assert judge(facts((1, 4), 0, 40_000)) == ["output OUTPUT_IDS has a value above 31999"]
    assert judge(facts((1, 4), -3, 5)) == ["output OUTPUT_IDS has a value below 0"]
    assert judge([]) == ["output OUTPUT_IDS missing"]
    assert judge([OutputFacts("OUTPUT_IDS", "INT32", (1, 4), 3, 0, 5)]) == [
        "output OUTPUT_IDS holds 3 values for shape [1, 4]"
    ]


def test_output_facts_read_a_response_and_nan_is_out_of_any_range() -> None:
    reply = service_pb2.ModelInferResponse()
    out = reply.outputs.add()
    out.name, out.datatype = "SCORE", "FP32"
    out.shape.extend([2])
    reply.raw_output_contents.append(np.array([0.5, np.nan], dtype=np.float32).tobytes())
    [fact] = output_facts(reply)
    assert fact.shape == (2,) and fact.count == 2 and fact.low == float("-inf")
    checks = {"SCORE": OutputCheck(datatype="FP32", shape=(2,), min_value=0.0, max_value=1.0)}
    assert check_outputs(reply, checks, items=1, input_tokens=1, output_tokens=1, batched=False) == [
        "output SCORE has a value below 0"
    ]
    assert check_outputs(reply, {}, items=1, input_tokens=1, output_tokens=1, batched=False) == []


def test_a_route_declares_outputs_and_so_does_a_streaming_route(tmp_path: Path) -> None:
    data = yaml.safe_load((ROOT / "routes" / "orchid.yaml").read_text())
    data["models"]["full-v18"]["outputs"] = {
        "OUTPUT_IDS": {"datatype": "INT32", "shape": ["items", "output_tokens"], "max_value": 31999}
    }
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(data))
    routes = load_routes(tmp_path)
    assert routes.models["full-v18"].outputs["OUTPUT_IDS"].max_value == 31999
    data["models"]["full-v18-stream"]["outputs"] = {
        "OUTPUT_IDS": {"datatype": "INT32", "shape": ["output_tokens"], "min_value": 0, "max_value": 31999}
    }
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(data))
    stream = load_routes(tmp_path).models["full-v18-stream"]
    # A stream's results are judged one by one: datatype and range, each result's own shape.
    result = service_pb2.ModelInferResponse()
    tensor = result.outputs.add(name="OUTPUT_IDS", datatype="INT32")
    tensor.shape.append(1)
    result.raw_output_contents.append(np.array([7], dtype=np.int32).tobytes())
    assert check_result(result, stream.outputs) == []
    result.raw_output_contents[0] = np.array([40_000], dtype=np.int32).tobytes()
    assert check_result(result, stream.outputs) == ["output OUTPUT_IDS has a value above 31999"]
    result.outputs[0].datatype = "FP32"
    assert check_result(result, stream.outputs)[0].startswith("output OUTPUT_IDS is FP32")
    with pytest.raises(ValueError, match="min_value must not exceed max_value"):
        RouteConfig.model_validate(
            {
                **data["models"]["compact-v11"],
                "outputs": {"X": {"datatype": "INT32", "shape": [1], "min_value": 2, "max_value": 1}},
            }
        )


# --------------------------------------------------------------------------- against Triton


def routes_with_contract(directory: Path, *, min_value: int) -> Path:
    """The example routes with an output contract on full-v18 (the emulator answers tokens in
    0..31999: ``min_value`` 0 holds for every answer, 32000 for none)."""
    shutil.copytree(ROOT / "routes", directory)
    path = directory / "orchid.yaml"
    data = yaml.safe_load(path.read_text())
    data["models"]["full-v18"]["outputs"] = {
        "OUTPUT_IDS": {"datatype": "INT32", "shape": ["items", "output_tokens"], "min_value": min_value}
    }
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return directory


@pytest.fixture
def contract_gateways(
    triton: LocalTriton, tmp_path: Path
) -> Iterator[tuple[ThreadedGateway, ThreadedGateway]]:
    valid = ThreadedGateway(
        gateway_config(triton.address, routes_dir=routes_with_contract(tmp_path / "ok", min_value=0))
    )
    broken = ThreadedGateway(
        gateway_config(triton.address, routes_dir=routes_with_contract(tmp_path / "bad", min_value=32000))
    )
    valid.start()
    broken.start()
    try:
        yield valid, broken
    finally:
        valid.stop()
        broken.stop()


def call(address: str) -> service_pb2.ModelInferResponse:
    with grpcclient.InferenceServerClient(address) as client:
        tensor = grpcclient.InferInput("INPUT_IDS", [1, 64], "INT32")
        tensor.set_data_from_numpy(np.arange(64, dtype=np.int32).reshape(1, 64))
        result = client.infer(
            "full-v18",
            [tensor],
            headers=bearer(ORCHID_KEY),
            parameters={"orchid.max_output_tokens": 8},
            client_timeout=5.0,
        )
        return result.get_response()


def test_a_production_answer_outside_its_routes_contract_is_refused_and_counted(
    contract_gateways: tuple[ThreadedGateway, ThreadedGateway],
) -> None:
    valid, broken = contract_gateways
    answer = call(valid.address)  # the contract holds: answered as ever
    assert answer.parameters["orchid.model"].string_param == "full-v18"
    assert list(answer.outputs[0].shape) == [1, 8]
    before = INVALID_OUTPUTS.labels("full-v18", "1", "refused")._value.get()
    with pytest.raises(InferenceServerException) as caught:
        call(broken.address)
    assert caught.value.status() == str(grpc.StatusCode.INTERNAL)
    message = caught.value.message()
    assert (
        "model 'full-v18' answered outside its output contract: output OUTPUT_IDS has a value below 32000"
        in (message or "")
    )
    assert INVALID_OUTPUTS.labels("full-v18", "1", "refused")._value.get() == before + 1
