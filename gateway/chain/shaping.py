"""Stage 3, shape: the request's tensors checked against its model, and its ``Shape``.

Owns validating the request's tensors against the placed model's spec (names, data
types, dims, sizes) and extracting what pricing reads: input and output tokens, items,
whether it is long, its payload bytes. It follows placement because the spec is what
the placed backend reports for the route's model. It also owns the fallback's shape
check: whether the warm fallback can take the request as asked.

It may read the request and the model spec; it may not touch pools, quota or policy.
"""

from __future__ import annotations

import msgspec

from gateway.chain.place import Placement
from gateway.chain.resolve import Resolved
from gateway.config import RouteConfig
from gateway.core.record import Mode, Shape
from gateway.shape import extract_shape, fallback_refusal, payload_bytes, validate_tensors


def shape_of(resolved: Resolved, placement: Placement) -> Shape:
    """The request's shape on its route (INVALID_ARGUMENT when its tensors do not fit)."""
    request = resolved.request
    shapes = validate_tensors(request, placement.spec, model=resolved.logical)
    return extract_shape(
        shapes,
        resolved.hints,
        placement.route.shape,
        model=resolved.logical,
        streaming=resolved.mode is Mode.STREAMING,
        input_bytes=payload_bytes(request),
    )


def fallback_shape(resolved: Resolved, shape: Shape, fallback: Placement, name: str) -> tuple[Shape, str]:
    """The request's shape on the fallback route, and why the fallback cannot take it as
    asked ("" when it can): its output capped at the fallback's limit."""
    route: RouteConfig = fallback.route
    refused = fallback_refusal(resolved.request, fallback.spec, route.shape, shape, model=name)
    capped = msgspec.structs.replace(
        shape, max_output_tokens=min(shape.max_output_tokens, route.shape.max_output_tokens)
    )
    return capped, refused
