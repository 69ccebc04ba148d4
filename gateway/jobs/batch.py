"""The batch codec: a JSONL snapshot in, KServe v2 gRPC requests out; responses back to JSON.

Owns the batch input format and the output set's per-item JSON. Each input line is a KServe
v2 JSON inference request body (``inputs``: ``name``, ``datatype``, ``shape``, ``data``,
optional ``parameters``; optional request ``parameters`` and ``outputs``) plus a
``custom_id`` the caller chooses, unique within the file. Every problem is refused before
anything is stored, with INVALID_ARGUMENT naming the line (never quoting its data); the
snapshot is identified by the SHA-256 of its bytes.

Outputs are the KServe v2 JSON response body: ``outputs`` (name, datatype, shape, data)
and ``parameters`` (the gateway's provenance, ``orchid.*``).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from tritonclient.grpc import service_pb2

from gateway.core.errors import InvalidArgument
from gateway.core.jobs import DTYPE_BYTES, MAX_CUSTOM_ID_CHARS, OutputFacts
from gateway.shape import CONTENTS_FIELD, NUMPY_DTYPES

_CONTENTS = CONTENTS_FIELD  # JSON data travels typed


@dataclass(frozen=True, slots=True)
class BatchInput:
    sha256: str
    items: list[tuple[str, bytes]]  # (custom_id, serialized ModelInferRequest)
    lines: list[int]  # each item's line number in the file


def _flatten(data: Any) -> list[Any]:
    if isinstance(data, list):
        out: list[Any] = []
        for element in data:
            out.extend(_flatten(element))
        return out
    return [data]


def _parameter(param: service_pb2.InferParameter, value: Any, where: str) -> None:
    if isinstance(value, bool):
        param.bool_param = value
    elif isinstance(value, int):
        param.int64_param = value
    elif isinstance(value, float):
        param.double_param = value
    elif isinstance(value, str):
        param.string_param = value
    else:
        raise InvalidArgument(f"{where}: a parameter must be a string, number or boolean")


def request_from_json(body: Any, model: str, where: str) -> service_pb2.ModelInferRequest:
    if not isinstance(body, dict):
        raise InvalidArgument(f"{where}: expected a JSON object")
    request = service_pb2.ModelInferRequest(model_name=model, id=str(body.get("id", ""))[:128])
    inputs = body.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise InvalidArgument(f"{where}: 'inputs' must be a non-empty list")
    for n, tensor in enumerate(inputs):
        at = f"{where}: inputs[{n}]"
        if not isinstance(tensor, dict):
            raise InvalidArgument(f"{at}: expected an object with name, datatype, shape, data")
        name, datatype, shape = tensor.get("name"), tensor.get("datatype"), tensor.get("shape")
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"{at}: 'name' must be a non-empty string")
        if datatype not in _CONTENTS:
            raise InvalidArgument(f"{at}: 'datatype' must be one of {', '.join(sorted(_CONTENTS))}")
        if (
            not isinstance(shape, list)
            or not shape
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise InvalidArgument(f"{at}: 'shape' must be a list of non-negative integers")
        data = _flatten(tensor.get("data"))
        elements = 1
        for d in shape:
            elements *= d
        if len(data) != elements:
            raise InvalidArgument(f"{at}: 'data' has {len(data)} elements; shape {shape} needs {elements}")
        out = request.inputs.add(name=name, datatype=datatype, shape=shape)
        field = getattr(out.contents, _CONTENTS[datatype])
        try:
            if datatype == "BYTES":
                field.extend(d.encode("utf-8") if isinstance(d, str) else bytes(d) for d in data)
            elif datatype == "BOOL":
                field.extend(bool(d) for d in data)
            elif datatype.startswith("FP"):
                field.extend(float(d) for d in data)
            else:
                if not all(isinstance(d, int) and not isinstance(d, bool) for d in data):
                    raise ValueError
                field.extend(data)
        except (ValueError, TypeError):
            raise InvalidArgument(f"{at}: 'data' does not fit datatype {datatype}") from None
        for key, value in (tensor.get("parameters") or {}).items():
            _parameter(out.parameters[str(key)], value, at)
    parameters = body.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidArgument(f"{where}: 'parameters' must be an object")
    for key, value in parameters.items():
        _parameter(request.parameters[str(key)], value, where)
    for output in body.get("outputs") or ():
        if isinstance(output, dict) and isinstance(output.get("name"), str):
            request.outputs.add(name=output["name"])
    return request


def parse_jsonl(data: bytes, *, model: str, max_items: int) -> BatchInput:
    """The snapshot's items, or INVALID_ARGUMENT naming the first bad line."""
    digest = hashlib.sha256(data).hexdigest()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidArgument("the batch input is not UTF-8") from None
    items: list[tuple[str, bytes]] = []
    lines: list[int] = []
    seen: set[str] = set()
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"line {number}"
        if len(items) >= max_items:
            raise InvalidArgument(f"the batch has more than {max_items} request lines (jobs.max_batch_items)")
        try:
            body = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            raise InvalidArgument(f"{where}: not valid JSON") from None
        if not isinstance(body, dict):
            raise InvalidArgument(f"{where}: expected a JSON object")
        custom_id = body.pop("custom_id", None)
        if not isinstance(custom_id, str) or not custom_id:
            raise InvalidArgument(f"{where}: 'custom_id' must be a non-empty string")
        if len(custom_id) > MAX_CUSTOM_ID_CHARS:
            raise InvalidArgument(f"{where}: 'custom_id' is longer than {MAX_CUSTOM_ID_CHARS} characters")
        if custom_id in seen:
            raise InvalidArgument(f"{where}: duplicate custom_id (each line needs its own)")
        seen.add(custom_id)
        items.append((custom_id, request_from_json(body, model, where).SerializeToString(deterministic=True)))
        lines.append(number)
    return BatchInput(digest, items, lines)


def _output_array(datatype: str, shape: list[int], raw: bytes) -> list[Any]:
    if datatype == "BYTES":
        values, offset = [], 0
        while offset + 4 <= len(raw):
            (length,) = struct.unpack_from("<I", raw, offset)
            offset += 4
            values.append(raw[offset : offset + length].decode("utf-8", "replace"))
            offset += length
        return values
    dtype = NUMPY_DTYPES.get(datatype)
    if dtype is None:
        return []
    array: list[Any] = np.frombuffer(raw, dtype=dtype).tolist()
    return array


def output_facts(response: service_pb2.ModelInferResponse) -> tuple[OutputFacts, ...]:
    """What validation needs of each output of a response (``gateway.core.jobs``)."""
    raw = list(response.raw_output_contents)
    return tuple(
        OutputFacts(
            name=o.name,
            datatype=o.datatype,
            shape=tuple(o.shape),
            raw_bytes=len(raw[i]) if i < len(raw) else None,
        )
        for i, o in enumerate(response.outputs)
    )


def response_json(response: service_pb2.ModelInferResponse) -> dict[str, Any]:
    """A response as the KServe v2 JSON body: outputs with data, and its parameters."""
    raw = list(response.raw_output_contents)
    outputs = []
    for i, o in enumerate(response.outputs):
        data = (
            _output_array(o.datatype, list(o.shape), raw[i])
            if i < len(raw) and o.datatype in DTYPE_BYTES | {"BYTES": 0}
            else []
        )
        outputs.append({"name": o.name, "datatype": o.datatype, "shape": list(o.shape), "data": data})
    return {
        "model_name": response.model_name,
        "model_version": response.model_version,
        "outputs": outputs,
        "parameters": provenance(response),
    }


def provenance(response: service_pb2.ModelInferResponse) -> dict[str, str]:
    """The response's ``orchid.*`` parameters as strings."""
    out: dict[str, str] = {}
    for key, param in response.parameters.items():
        if not key.startswith("orchid."):
            continue
        which = param.WhichOneof("parameter_choice")
        value = getattr(param, which) if which else ""
        out[key] = str(value).lower() if isinstance(value, bool) else str(value)
    return out
