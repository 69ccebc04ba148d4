"""Diagnostic only: ``orchid-gateway serve`` with parts of its request path taken out.

``bench/overhead.py --ablate PARTS`` starts the gateway through this script to measure what
each part costs in the live process (CPU per request behind gRPC), which in-process
profiles misjudge: a part's cost in place depends on what runs around it (caches, the
event loop's batching). An ablated gateway is not a gateway; never serve traffic with it.

PARTS (comma-separated):

* ``policy``: ``PolicyStore.evaluate`` answers each (tenant, model, class) with the first
  result it computed: no policy inputs read, no CEL, no evaluation metrics.
* ``telemetry``: the request path's listeners (Prometheus metrics, decision log, status
  board) receive nothing.
* ``provenance``: responses carry no provenance parameters.
* ``decisions``: the whole decision path replaced by the gateway's edge alone: authenticate,
  parse, read the hints, resolve the tenant's route, build the backend request, forward it
  with the class's default deadline, rename the model in the answer. What any gateway with this edge
  pays before it decides anything.

    python bench/ablate.py --ablate policy,telemetry serve --config gateway.yaml
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PARTS = ("policy", "telemetry", "provenance", "decisions")


def ablate(parts: set[str]) -> None:
    import gateway.pipeline as pipeline
    from gateway.chain import backend_request as chain_backend_request
    from gateway.core.record import Mode
    from gateway.exchange import CallContext
    from gateway.messages import parse_infer_request
    from gateway.policy.store import PolicyStore
    from gateway.shape import read_hints
    from gateway.telemetry import ListenerGroup

    if "policy" in parts:
        evaluate = PolicyStore.evaluate
        answers: dict[tuple[str, str, str], Any] = {}

        def first_answer(self: PolicyStore, record: Any, context: Any, snapshot: Any = None) -> Any:
            key = (record.identity.tenant, record.identity.model, record.identity.request_class)
            if key not in answers:
                answers[key] = evaluate(self, record, context, snapshot)
            return answers[key]

        PolicyStore.evaluate = first_answer  # type: ignore[method-assign]
    if "telemetry" in parts:
        ListenerGroup.decided = lambda self, *args: None  # type: ignore[method-assign]
        ListenerGroup.settled = lambda self, *args: None  # type: ignore[method-assign]
    if "provenance" in parts:
        import gateway.chain as chain

        setattr(chain, "attach_provenance", lambda response, settled: None)  # noqa: B010
    if "decisions" in parts:

        async def edge(self: pipeline.Gateway, raw: bytes, call: CallContext) -> Any:
            tenant = self.tenants.authenticate(call.metadata, peer_subjects=call.peer_subjects)
            request = parse_infer_request(raw)
            route = self.tenant_route(tenant, request.model_name)
            handle = self.backends[self.pools.candidate_backends(route, tenant.config.home_cell)[0]]
            hints = read_hints(request)
            _, request_class = self.chain.resolve.request_class(hints.request_class)
            max_output = hints.max_output_tokens or route.shape.max_output_tokens
            backend_request = chain_backend_request(request, route, max_output, Mode.ONLINE)
            response = await handle.client.infer(
                backend_request,
                timeout_s=request_class.default_deadline_ms / 1000.0,
                logical=request.model_name,
            )
            response.model_name = request.model_name
            return response

        pipeline.Gateway.infer = edge  # type: ignore[method-assign]


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "--ablate":
        print(__doc__, file=sys.stderr)
        return 2
    parts = {p.strip() for p in argv[1].split(",") if p.strip()}
    unknown = parts - set(PARTS)
    if unknown or not parts:
        print(f"--ablate: unknown {sorted(unknown)}; choose from {', '.join(PARTS)}", file=sys.stderr)
        return 2
    ablate(parts)
    from orchid_tools.cli import main as cli

    return cli(argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
