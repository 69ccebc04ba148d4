"""Model entitlement: which logical models a tenant may call. Decided here and nowhere else.

A tenant may call exactly the logical models listed in its ``models`` (tenants file), and
nothing else. The key is required, so an absent list is a configuration error, never
"everything"; an empty list entitles the tenant to no model at all (a credential that is
used only for admin RPCs, or one not yet enabled). A list is never widened by a rule, a
default or a route.

Two places ask, and both ask ``may_call``:

* the request path (``gateway.auth.Tenant.may_call``, through ``Gateway.tenant_route``):
  a model the tenant may not call answers NOT_FOUND, exactly like a missing one;
* policy, which reads the answer as the fact ``tenant.entitled`` (``gateway.policy.schema``)
  for the request's model, the fallback candidate's model included; the ``model-allowed``
  rule denies when it is false and never re-derives it from ``tenant.allowed_models``.
"""

from __future__ import annotations

from collections.abc import Collection


def may_call(models: Collection[str], model: str) -> bool:
    """Whether a tenant whose configured ``models`` are these may call ``model``.

    The configured list is the whole entitlement: an empty list allows nothing."""
    return model in models
