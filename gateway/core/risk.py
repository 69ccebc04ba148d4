"""Risk classes: which class a request runs under. Decided here and nowhere else.

The gateway configuration declares the risk classes in order, lowest first
(``risk_classes``; default ``standard``, ``out_of_distribution``, ``regulated``,
``safety_critical``). A tenant (tenants file) and a route (routes file) each declare a
``risk_class``, a minimum: a request runs under the highest of the two, or under the class
its caller names in the ``orchid.risk_class`` parameter. A caller may raise the class, never
lower it:

* a name that is not declared: INVALID_ARGUMENT, naming the declared set;
* a class below the tenant's or the route's: PERMISSION_DENIED, naming the minimum.

The class is ``Identity.risk_class``, so policy reads it as ``request.risk_class``; which
classes may be degraded (fallback, reduced output) is policy's (``policies/40-fallback.yaml``,
``policies/30-quota.yaml``). Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.core.errors import InvalidArgument, PermissionDenied

DEFAULT_RISK_CLASSES: tuple[str, ...] = ("standard", "out_of_distribution", "regulated", "safety_critical")
RISK_PARAMETER = "orchid.risk_class"


def resolve_risk_class(
    declared: Sequence[str], *, tenant_default: str, route_default: str, requested: str | None
) -> str:
    """The class a request runs under (see the module docstring); raises a caller-facing error
    for an undeclared class or one below the tenant's or the route's minimum."""
    floor = max(tenant_default, route_default, key=declared.index)
    if requested is None:
        return floor
    if requested not in declared:
        raise InvalidArgument(
            f"parameter {RISK_PARAMETER} names unknown risk class {requested[:64]!r}; "
            f"declared: {', '.join(declared)}"
        )
    if declared.index(requested) < declared.index(floor):
        whose = "this credential" if floor == tenant_default else "this model"
        raise PermissionDenied(
            f"risk class {requested!r} is below {floor!r}, the minimum for {whose}: "
            "a caller may raise its risk class, never lower it"
        )
    return requested


__all__ = ["DEFAULT_RISK_CLASSES", "RISK_PARAMETER", "resolve_risk_class"]
