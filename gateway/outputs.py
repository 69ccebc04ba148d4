"""Output contracts at runtime: a backend's answer, read as facts and judged before it leaves.

The contract itself (``OutputCheck``) and its judgement (``output_problems``) live in
``gateway.core.outputs``; this module only decodes a ``ModelInferResponse`` into
``OutputFacts`` (shape, datatype, value count, lowest and highest value: never the values
themselves) and counts what it finds. Used by the request path for a route's declared
``outputs`` and by rollouts for a candidate's declared outputs (warm-up, canary, shadow);
a stream's results one by one (``check_result``: datatype and range).

Metric: ``orchid_invalid_outputs_total{model,version,action}`` (``refused``: the caller got
INTERNAL, rule ``output.contract``; ``fallback``: answered from the warm fallback;
``hedged``: a canary answered again by the current version; ``discarded``: a shadow's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
from prometheus_client import Counter
from tritonclient.grpc import service_pb2

from gateway.core.outputs import OutputCheck, OutputFacts, output_problems
from gateway.policy.metrics import get_or_create
from gateway.shape import NUMPY_DTYPES

INVALID_OUTPUTS: Counter = get_or_create(
    "orchid_invalid_outputs",
    lambda: Counter(
        "orchid_invalid_outputs",
        "Answers outside their declared output contract, by what was done with them "
        "(refused, fallback, hedged, discarded)",
        ["model", "version", "action"],
    ),
)


def output_facts(response: service_pb2.ModelInferResponse) -> list[OutputFacts]:
    """The facts a contract reads of each output tensor (raw contents; a tensor sent in the
    typed ``contents`` fields, or of a datatype not decoded here, keeps ``count=None``: its
    datatype and shape are still checked)."""
    facts: list[OutputFacts] = []
    raw = response.raw_output_contents
    for index, output in enumerate(response.outputs):
        shape = tuple(int(d) for d in output.shape)
        dtype = NUMPY_DTYPES.get(output.datatype)
        if dtype is None or index >= len(raw):
            facts.append(OutputFacts(output.name, output.datatype, shape, None, None, None))
            continue
        values = np.frombuffer(raw[index], dtype=dtype)
        low: float | None
        high: float | None
        if values.size and np.issubdtype(values.dtype, np.floating) and not np.isfinite(values).all():
            low, high = float("-inf"), float("inf")  # NaN or infinity: outside any declared range
        else:
            low = float(values.min()) if values.size else None
            high = float(values.max()) if values.size else None
        facts.append(OutputFacts(output.name, output.datatype, shape, int(values.size), low, high))
    return facts


def check_outputs(
    response: service_pb2.ModelInferResponse,
    checks: Mapping[str, OutputCheck],
    *,
    items: int,
    input_tokens: int,
    output_tokens: int,
    batched: bool,
) -> list[str]:
    """What is wrong with ``response``'s outputs against the declared checks ([] = valid)."""
    if not checks:
        return []
    return output_problems(
        output_facts(response),
        checks,
        items=items,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        batched=batched,
    )


def check_result(response: service_pb2.ModelInferResponse, checks: Mapping[str, OutputCheck]) -> list[str]:
    """What is wrong with one result of a stream ([] = valid): each output's datatype and value
    range against the declared checks. A stream's result is a piece of the answer, so its
    shape is its own (the whole answer's shape is judged where the whole answer is seen: a
    rollout's warm-up, ``gateway.backends.base.infer_streamed``)."""
    if not checks:
        return []
    own = {
        output.name: dataclasses.replace(check, shape=tuple(int(d) for d in output.shape))
        for output in response.outputs
        if (check := checks.get(output.name)) is not None
    }
    return output_problems(
        output_facts(response), own, items=1, input_tokens=0, output_tokens=0, batched=False
    )
