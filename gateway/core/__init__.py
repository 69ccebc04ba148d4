"""The decision core: pure functions and state machines over immutable records.

Nothing here does I/O or reads a clock: every decision takes ``now`` as an
argument, so the same code runs the live gateway (``gateway.chain`` drives
it on the event loop's clock) and the simulator (``orchid_tools.simulate``
drives it in virtual time). CI enforces it (``[tool.importlinter]`` in pyproject.toml,
run by ``lint-imports`` in scripts/test.sh): no module under
``gateway.core`` imports asyncio, grpc, time or the runtime around it, nor logging,
pydantic, policy evaluation or the configuration layer: configuration is validated by
``gateway.settings`` / ``gateway.config`` and handed in as plain frozen values.

    record     the resource-and-outcome record (identity, shape, demand, budget, outcome)
    profile    demand profiles: accelerator-ms by phase, padding, memory
    estimate   prediction and its correction from observed work
    pricing    a request's record on one pool: demand, budget, predicted queue wait
    settlement charging observed work, teaching the estimator, refunds
    quota      the quota ledger: reserve, settle, borrow
    overload   demand windows, the ladder, fair allocation and flow plans
    load       one pool's load: offered/admitted demand per flow, the plan
    dispatch   the fair-share dispatch queue with device list-scheduling
    memory     device memory: resident models, live state, the live-memory bound's refusals
    admission  the admission decision from priced candidates and policy results
    policy_result what the policy set decided for one request (gateway.policy evaluates it)
    errors     the domain error tree (statuses by name; the edge maps them)
    entitlement which models a tenant may call (the one answer auth and policy share)
    evidence   quality evidence and the verdict: may a route degrade on it now
    risk       a request's risk class: the tenant's and route's minimum, raised never lowered
"""
