"""Request validation and shape extraction: a ModelInferRequest in, a ``Shape`` out.

Pure functions over the decoded protobuf and the backend model's spec: no I/O.
Everything a caller can get wrong in the tensors or parameters is caught here
and reported as ``InvalidArgument`` naming the field, before any accelerator
time is spent:

* inputs unknown to the model, missing required inputs, wrong datatype;
* wrong rank, negative dims, dims that disagree with the model's fixed dims,
  element counts that overflow the gateway's bound;
* ``raw_input_contents`` whose count or byte length disagrees with
  shape x datatype size (BYTES: well-formed 4-byte length prefixes);
* ``orchid.*`` parameters of the wrong type or out of range (a stream's objectives,
  ``orchid.first_result_ms`` and ``orchid.gap_ms``: positive milliseconds, int or double,
  at most the class's ``max_deadline_ms``, see ``stream_objectives_for``);
* shapes over the route's declared caps (input tokens, items, output tokens).

How tokens and items are read is data (``ShapeSpec`` in ``routes/``).
"""

from __future__ import annotations

import math

import msgspec
import numpy as np
from tritonclient.grpc import service_pb2

from gateway.backends.triton import ModelSpec
from gateway.config import RequestClassConfig, ShapeSpec
from gateway.core.admission import FallbackLimits, fallback_misfit
from gateway.core.errors import InvalidArgument
from gateway.core.prefix import SCOPE_PARAMETER, TOKEN_BYTES
from gateway.core.record import LONG_BUCKET, SHORT_BUCKET, Shape
from gateway.core.streaming import StreamObjectives, stream_objectives

DTYPE_BYTES: dict[str, int] = {
    "BOOL": 1,
    "UINT8": 1,
    "UINT16": 2,
    "UINT32": 4,
    "UINT64": 8,
    "INT8": 1,
    "INT16": 2,
    "INT32": 4,
    "INT64": 8,
    "FP16": 2,
    "BF16": 2,
    "FP32": 4,
    "FP64": 8,
}

# Far above any real tensor the gateway fronts, far below int64 overflow: a shape whose
# element count passes this is refused before anything multiplies it by a dtype size.
MAX_ELEMENTS = 1 << 31

# numpy dtype per datatype, for reading raw output tensors (the one table: output checks and
# jobs read it; BF16 has no numpy dtype)
NUMPY_DTYPES: dict[str, type[np.generic]] = {
    "BOOL": np.bool_,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
}

# typed `contents` field of InferTensorContents per datatype (the one table: jobs read it too)
CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


class RequestHints(msgspec.Struct, frozen=True, gc=False):
    """The optional ``orchid.*`` request parameters (ARCHITECTURE §5)."""

    request_class: str | None = None
    max_output_tokens: int | None = None
    allow_fallback: bool = True
    operation_id: str = ""
    risk_class: str | None = None  # orchid.risk_class (checked by gateway.core.risk)
    # A stream's objectives (ModelStreamInfer only; gateway.core.streaming), in ms:
    first_result_ms: float | None = None  # orchid.first_result_ms: first result after arrival
    gap_ms: float | None = None  # orchid.gap_ms: most time between two results


# The largest stream objective a caller may name (one day); the class's max deadline bounds it too.
MAX_OBJECTIVE_MS = 86_400_000.0


def _param_kind(param: service_pb2.InferParameter) -> str | None:
    kind: str | None = param.WhichOneof("parameter_choice")
    return kind


def _objective_ms(request: service_pb2.ModelInferRequest, name: str) -> float | None:
    """A stream objective parameter: a positive, finite number of milliseconds (int or double)."""
    params = request.parameters
    if name not in params:
        return None
    p = params[name]
    kind = _param_kind(p)
    if kind == "double_param":
        value = float(p.double_param)
    elif kind == "int64_param":
        value = float(p.int64_param)
    elif kind == "uint64_param":
        value = float(p.uint64_param)
    else:
        raise InvalidArgument(f"parameter {name} must be a number of milliseconds (int or double)")
    if not (math.isfinite(value) and 0 < value <= MAX_OBJECTIVE_MS):
        raise InvalidArgument(
            f"parameter {name} must be a number of milliseconds > 0 and <= {MAX_OBJECTIVE_MS:g}, "
            f"got {value:g}"
        )
    return value


def read_hints(request: service_pb2.ModelInferRequest) -> RequestHints:
    params = request.parameters
    request_class: str | None = None
    max_output: int | None = None
    allow_fallback = True
    operation_id = ""
    if "orchid.class" in params:
        p = params["orchid.class"]
        if _param_kind(p) != "string_param" or not p.string_param:
            raise InvalidArgument("parameter orchid.class must be a non-empty string")
        request_class = p.string_param
    if "orchid.max_output_tokens" in params:
        p = params["orchid.max_output_tokens"]
        kind = _param_kind(p)
        if kind == "int64_param":
            max_output = int(p.int64_param)
        elif kind == "uint64_param":
            max_output = int(p.uint64_param)
        else:
            raise InvalidArgument("parameter orchid.max_output_tokens must be an integer")
        if max_output < 1:
            raise InvalidArgument(f"parameter orchid.max_output_tokens must be >= 1, got {max_output}")
    if "orchid.allow_fallback" in params:
        p = params["orchid.allow_fallback"]
        if _param_kind(p) != "bool_param":
            raise InvalidArgument("parameter orchid.allow_fallback must be a bool")
        allow_fallback = bool(p.bool_param)
    if "orchid.operation_id" in params:
        p = params["orchid.operation_id"]
        if _param_kind(p) != "string_param" or not (0 < len(p.string_param) <= 128):
            raise InvalidArgument("parameter orchid.operation_id must be a string of 1-128 characters")
        operation_id = p.string_param
    risk_class: str | None = None
    if "orchid.risk_class" in params:
        p = params["orchid.risk_class"]
        if _param_kind(p) != "string_param" or not p.string_param:
            raise InvalidArgument("parameter orchid.risk_class must be a non-empty string")
        risk_class = p.string_param
    first_result_ms = _objective_ms(request, "orchid.first_result_ms")
    gap_ms = _objective_ms(request, "orchid.gap_ms")
    for name in params:
        if name.startswith("orchid.") and name not in _KNOWN_HINTS:
            raise InvalidArgument(f"unknown parameter {name!r}; known: {', '.join(sorted(_KNOWN_HINTS))}")
    return RequestHints(
        request_class, max_output, allow_fallback, operation_id, risk_class, first_result_ms, gap_ms
    )


def stream_objectives_for(
    hints: RequestHints, request_class: RequestClassConfig, deadline_ms: float
) -> StreamObjectives:
    """A stream's objectives: the caller's ``orchid.first_result_ms`` / ``orchid.gap_ms`` over
    its class's ``first_result_ms`` / ``gap_ms``, bounded by the class's ``max_deadline_ms``
    (INVALID_ARGUMENT above it); the completion deadline is ``deadline_ms`` (the call's, or
    the class's default). Pass ``first_result_ms`` and ``gap_ms`` to ``pricing.Reserves``."""
    return stream_objectives(
        deadline_ms=deadline_ms,
        max_deadline_ms=request_class.max_deadline_ms,
        class_first_result_ms=request_class.first_result_ms,
        class_gap_ms=request_class.gap_ms,
        requested_first_result_ms=hints.first_result_ms,
        requested_gap_ms=hints.gap_ms,
    )


_KNOWN_HINTS = frozenset(
    {
        "orchid.class",
        "orchid.max_output_tokens",
        "orchid.allow_fallback",
        "orchid.operation_id",
        "orchid.risk_class",
        "orchid.first_result_ms",
        "orchid.gap_ms",
    }
)

# Triton request parameters that steer the backend on the caller's behalf. Through a shared
# gateway they would let one tenant join another's sequence or read a registered
# shared-memory region, so they are refused (sequence, shared memory) or owned by the
# gateway (priority, timeout: it sets deadlines and order itself; devices: on a backend with
# a topology it names the unit the gateway reserved, dispatch rule 10).
REFUSED_PARAMETERS = frozenset({"sequence_id", "sequence_start", "sequence_end"})
DEVICES_PARAMETER = "devices"
# prefix_scope (gateway.core.prefix.SCOPE_PARAMETER): the prefix-cache scope the gateway sends
# to a model with a prefix cache; a caller's own would let it read another scope's entries.
GATEWAY_OWNED_PARAMETERS = frozenset({"priority", "timeout", DEVICES_PARAMETER, SCOPE_PARAMETER})
_SHARED_MEMORY_PREFIX = "shared_memory_"


def check_backend_controls(request: service_pb2.ModelInferRequest) -> None:
    """Refuse parameters that would let a caller steer Triton past the gateway."""
    for name in request.parameters:
        if name in REFUSED_PARAMETERS:
            raise InvalidArgument(f"parameter {name!r} is not available through the gateway")
    for tensor in [*request.inputs, *request.outputs]:
        if any(name.startswith(_SHARED_MEMORY_PREFIX) for name in tensor.parameters):
            raise InvalidArgument(
                f"tensor {tensor.name!r}: shared memory is not available through the gateway; "
                "send the data inline"
            )


def _element_count(name: str, shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        if dim < 0:
            raise InvalidArgument(f"input {name!r}: negative dimension {dim} in shape {list(shape)}")
        count *= dim
        if count > MAX_ELEMENTS:
            raise InvalidArgument(
                f"input {name!r}: shape {list(shape)} has more than {MAX_ELEMENTS} elements"
            )
    return count


def _check_bytes_payload(name: str, raw: bytes, count: int) -> None:
    offset = 0
    for _ in range(count):
        if offset + 4 > len(raw):
            raise InvalidArgument(f"input {name!r}: BYTES payload ends inside an element length prefix")
        length = int.from_bytes(raw[offset : offset + 4], "little")
        offset += 4 + length
        if offset > len(raw):
            raise InvalidArgument(f"input {name!r}: BYTES element runs past the end of raw_input_contents")
    if offset != len(raw):
        raise InvalidArgument(f"input {name!r}: raw_input_contents has {len(raw) - offset} trailing bytes")


def validate_tensors(
    request: service_pb2.ModelInferRequest, spec: ModelSpec, *, model: str
) -> dict[str, tuple[int, ...]]:
    """Check every input, and every output the request names, against the model spec; return
    input name -> shape."""
    shapes: dict[str, tuple[int, ...]] = {}
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidArgument(
            f"raw_input_contents has {len(raw)} entries but the request declares {len(request.inputs)} inputs"
        )
    for index, tensor in enumerate(request.inputs):
        declared = spec.input(tensor.name)
        if declared is None:
            known = ", ".join(s.name for s in spec.inputs)
            raise InvalidArgument(f"model {model!r} has no input {tensor.name!r} (inputs: {known})")
        if tensor.name in shapes:
            raise InvalidArgument(f"input {tensor.name!r} appears twice")
        if tensor.datatype != declared.datatype:
            raise InvalidArgument(
                f"input {tensor.name!r}: datatype {tensor.datatype or '(empty)'} but model {model!r} expects "
                f"{declared.datatype}"
            )
        shape = tuple(int(d) for d in tensor.shape)
        if len(shape) != len(declared.shape):
            raise InvalidArgument(
                f"input {tensor.name!r}: shape {list(shape)} has rank {len(shape)}, model {model!r} expects "
                f"rank {len(declared.shape)} {list(declared.shape)}"
            )
        count = _element_count(tensor.name, shape)
        for got, want in zip(shape, declared.shape, strict=True):
            if want >= 0 and got != want:
                raise InvalidArgument(
                    f"input {tensor.name!r}: shape {list(shape)} does not match "
                    f"model shape {list(declared.shape)}"
                )
        if spec.max_batch_size > 0 and shape and shape[0] > spec.max_batch_size:
            raise InvalidArgument(
                f"input {tensor.name!r}: batch {shape[0]} exceeds the model's "
                f"max batch size {spec.max_batch_size}"
            )
        if raw:
            payload = raw[index]
            if tensor.datatype == "BYTES":
                _check_bytes_payload(tensor.name, payload, count)
            else:
                expected = count * DTYPE_BYTES.get(tensor.datatype, 0)
                if len(payload) != expected:
                    raise InvalidArgument(
                        f"input {tensor.name!r}: raw_input_contents is {len(payload)} bytes but shape "
                        f"{list(shape)} x {tensor.datatype} needs {expected}"
                    )
        else:
            field = CONTENTS_FIELD.get(tensor.datatype)
            if field is None:
                raise InvalidArgument(
                    f"input {tensor.name!r}: datatype {tensor.datatype} needs raw_input_contents"
                )
            have = len(getattr(tensor.contents, field))
            if have != count:
                raise InvalidArgument(
                    f"input {tensor.name!r}: contents has {have} elements "
                    f"but shape {list(shape)} needs {count}"
                )
        shapes[tensor.name] = shape
    for declared in spec.inputs:
        if declared.name not in shapes and not declared.optional:
            raise InvalidArgument(f"model {model!r} requires input {declared.name!r}")
    if request.outputs:  # refused here, before any admission or backend work, as inputs are
        requested: set[str] = set()
        for output in request.outputs:
            if output.name not in spec.outputs:
                known = ", ".join(spec.outputs)
                raise InvalidArgument(f"model {model!r} has no output {output.name!r} (outputs: {known})")
            if output.name in requested:
                raise InvalidArgument(f"output {output.name!r} is requested twice")
            requested.add(output.name)
    return shapes


def extract_shape(
    shapes: dict[str, tuple[int, ...]],
    hints: RequestHints,
    spec: ShapeSpec,
    *,
    model: str,
    streaming: bool,
    input_bytes: int,
) -> Shape:
    tokens_shape = shapes.get(spec.tokens_input)
    if tokens_shape is None:
        raise InvalidArgument(f"model {model!r}: input {spec.tokens_input!r} (the token tensor) is missing")
    try:
        tokens = tokens_shape[spec.tokens_dim]
        items = tokens_shape[spec.items_dim] if spec.items_dim is not None else 1
    except IndexError:
        raise InvalidArgument(
            f"model {model!r}: input {spec.tokens_input!r} has too few dimensions"
        ) from None
    if tokens < 1:
        raise InvalidArgument(f"input {spec.tokens_input!r}: needs at least one token, got {tokens}")
    if tokens > spec.max_input_tokens:
        raise InvalidArgument(
            f"input {spec.tokens_input!r}: {tokens} tokens exceeds the limit of "
            f"{spec.max_input_tokens} for {model!r}"
        )
    if items < 1 or items > spec.max_items:
        raise InvalidArgument(f"input {spec.tokens_input!r}: {items} items is outside 1..{spec.max_items}")
    max_output = (
        hints.max_output_tokens if hints.max_output_tokens is not None else spec.default_max_output_tokens
    )
    if max_output > spec.max_output_tokens:
        raise InvalidArgument(
            f"parameter orchid.max_output_tokens: {max_output} exceeds the limit of {spec.max_output_tokens} "
            f"for {model!r}"
        )
    bucket = LONG_BUCKET if tokens > spec.long_input_tokens else SHORT_BUCKET
    return Shape(
        items=items,
        input_tokens=tokens,
        max_output_tokens=max_output,
        streaming=streaming,
        bucket=bucket,
        input_bytes=input_bytes,
    )


def fallback_refusal(
    request: service_pb2.ModelInferRequest,
    spec: ModelSpec,
    shape_spec: ShapeSpec,
    shape: Shape,
    *,
    model: str,
) -> str:
    """Why the fallback model cannot take ``request`` ("" when it can): its tensors (the
    fallback's inputs, their datatypes, ranks and batch size: modality and datatype) and its
    route's shape caps on the request as asked (``shape``: input tokens as the fallback reads
    them, the requested output, items)."""
    try:
        shapes = validate_tensors(request, spec, model=model)
        tokens_shape = shapes.get(shape_spec.tokens_input)
        if tokens_shape is None:
            return f"the fallback {model!r} reads its tokens from input {shape_spec.tokens_input!r}"
        tokens = tokens_shape[shape_spec.tokens_dim]
        items = tokens_shape[shape_spec.items_dim] if shape_spec.items_dim is not None else 1
    except InvalidArgument as error:
        return f"the fallback {model!r} does not take its tensors: {error}"
    except IndexError:
        return f"the fallback {model!r}: input {shape_spec.tokens_input!r} has too few dimensions"
    return fallback_misfit(
        Shape(items=items, input_tokens=tokens, max_output_tokens=shape.max_output_tokens),
        FallbackLimits(
            model=model,
            max_input_tokens=shape_spec.max_input_tokens,
            max_output_tokens=shape_spec.max_output_tokens,
            max_items=shape_spec.max_items,
        ),
    )


def payload_bytes(request: service_pb2.ModelInferRequest) -> int:
    return sum(len(r) for r in request.raw_input_contents)


def prompt_bytes(request: service_pb2.ModelInferRequest, input_name: str) -> bytes:
    """The first sequence of the tokens input ``input_name`` as little-endian INT32 bytes (b""
    when absent): the prompt a prefix cache keys (``gateway.core.prefix.block_keys``), read the
    same way by the gateway's affinity and by ``MemoryBackend``'s cache."""
    for i, tensor in enumerate(request.inputs):
        if tensor.name != input_name:
            continue
        if i < len(request.raw_input_contents):
            raw = request.raw_input_contents[i]
        else:
            raw = np.asarray(tensor.contents.int_contents, dtype="<i4").tobytes()
        shape = tuple(tensor.shape)
        if len(shape) >= 2 and shape[0] > 1:  # [rows, n]: the first row is the prompt
            raw = raw[: shape[-1] * TOKEN_BYTES]
        return bytes(raw)
    return b""
