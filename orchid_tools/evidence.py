"""``orchid-gateway evidence publish|list``: record and show quality evidence through the
gateway's admin RPC (``orchid.admin.v1.GatewayAdmin/PublishEvidence``, ``ListEvidence``).

A published evaluation governs the route's fallback and reduced output from the next
request (``gateway.evidence``). The admin key comes from ``--key`` or the environment
variable ``ORCHID_ADMIN_KEY``; the gateway is reached at ``--address`` (plaintext, or TLS
with ``--ca``). ``publish_evidence`` and ``list_evidence`` are the functions the command
calls, for scripts and tests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc

from gateway._proto import admin_pb2
from gateway.config import parse_time

KEY_ENV = "ORCHID_ADMIN_KEY"
SERVICE = admin_pb2.DESCRIPTOR.services_by_name["GatewayAdmin"].full_name
DAY_S = 86400.0


def _channel(address: str, ca: str | None) -> grpc.Channel:
    if ca:
        return grpc.secure_channel(address, grpc.ssl_channel_credentials(Path(ca).read_bytes()))
    return grpc.insecure_channel(address)


def _metadata(key: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {key}"),)


def _call(
    channel: grpc.Channel, method: str, request: Any, reply_type: Any, key: str, timeout_s: float
) -> Any:
    rpc = channel.unary_unary(
        f"/{SERVICE}/{method}",
        request_serializer=lambda message: message.SerializeToString(),
        response_deserializer=reply_type.FromString,
    )
    return rpc(request, metadata=_metadata(key), timeout=timeout_s)


def publish_evidence(
    address: str,
    key: str,
    *,
    model: str,
    population: str,
    score: float,
    samples: int,
    owner: str,
    version: str = "",
    output_cap: int = 0,
    evaluated_at: float = 0.0,
    review_by: float = 0.0,
    max_age_s: float = 0.0,
    ca: str | None = None,
    timeout_s: float = 10.0,
) -> admin_pb2.EvidenceRecord:
    """Publish one evaluation; returns it as recorded. Raises ``grpc.RpcError`` on refusal."""
    evidence = admin_pb2.EvidenceRecord(
        model=model,
        version=version,
        population=population,
        output_cap=output_cap,
        score=score,
        sample_size=samples,
        owner=owner,
        evaluated_at=evaluated_at,
        review_by=review_by,
        max_age_s=max_age_s,
    )
    with _channel(address, ca) as channel:
        request = admin_pb2.PublishEvidenceRequest(evidence=evidence)
        reply = _call(channel, "PublishEvidence", request, admin_pb2.PublishEvidenceResponse, key, timeout_s)
    recorded: admin_pb2.EvidenceRecord = reply.evidence
    return recorded


def list_evidence(
    address: str, key: str, *, ca: str | None = None, timeout_s: float = 10.0
) -> admin_pb2.ListEvidenceResponse:
    with _channel(address, ca) as channel:
        request = admin_pb2.ListEvidenceRequest()
        reply: admin_pb2.ListEvidenceResponse = _call(
            channel, "ListEvidence", request, admin_pb2.ListEvidenceResponse, key, timeout_s
        )
    return reply


def _date(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds") if seconds else ""


def listing_json(reply: admin_pb2.ListEvidenceResponse) -> dict[str, Any]:
    return {
        "evidence": [
            {
                "model": e.model,
                "version": e.version,
                "population": e.population,
                "output_cap": e.output_cap,
                "score": e.score,
                "sample_size": e.sample_size,
                "owner": e.owner,
                "evaluated_at": _date(e.evaluated_at) or None,
                "review_by": _date(e.review_by) or None,
                "max_age_days": e.max_age_s / DAY_S if e.max_age_s else None,
                "source": e.source,
            }
            for e in reply.evidence
        ],
        "routes": [
            {
                "route": r.route,
                "degradation": r.degradation,
                "status": r.status,
                "floor": r.floor,
                "model": r.model,
                "version": r.version,
                "population": r.population,
                "output_cap": r.output_cap,
                "expires_at": _date(r.expires_at) or None,
            }
            for r in reply.routes
        ],
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("publish", "list"), help="publish one evaluation, or list")
    parser.add_argument("--address", default="127.0.0.1:8001", help="the gateway's gRPC address")
    parser.add_argument("--key", default=None, help=f"admin key (default: ${KEY_ENV})")
    parser.add_argument("--ca", default=None, help="CA certificate (PEM) for a TLS gateway")
    parser.add_argument("--model", help="publish: the logical model (route name) evaluated")
    parser.add_argument("--version", default="", help="publish: model version (default: the route's)")
    parser.add_argument("--population", help="publish: the evaluation population")
    parser.add_argument("--score", type=float, help="publish: quality score in [0, 1]")
    parser.add_argument("--samples", type=int, help="publish: number of evaluated samples")
    parser.add_argument("--owner", help="publish: who answers for this evidence")
    parser.add_argument("--output-cap", type=int, default=0, help="publish: output cap N (0: full)")
    parser.add_argument("--evaluated-at", default=None, help="publish: ISO date evaluated (default: now)")
    expiry = parser.add_mutually_exclusive_group()
    expiry.add_argument("--review-by", default=None, help="publish: ISO date the evidence expires")
    expiry.add_argument("--max-age-days", type=float, default=None, help="publish: days it stays valid")
    parser.add_argument("--json", action="store_true", help="list: machine-readable output")


def run(args: argparse.Namespace) -> int:
    key = admin_key(args, "evidence")
    if not key:
        return 2
    try:
        if args.action == "publish":
            return _publish(args, key)
        return _list(args, key)
    except grpc.RpcError as error:
        return refused(f"evidence {args.action}", error)


def admin_key(args: argparse.Namespace, command: str) -> str:
    """The admin key from ``--key`` or ``$ORCHID_ADMIN_KEY`` ("" after saying it is missing)."""
    key: str = args.key or os.environ.get(KEY_ENV, "")
    if not key:
        print(f"{command}: an admin key is needed (--key or ${KEY_ENV})", file=sys.stderr)
    return key


def refused(command: str, error: grpc.RpcError) -> int:
    """Say why an admin call failed; the exit code: 3 when the gateway is unreachable, else 1."""
    code = error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = error.details() if isinstance(error, grpc.Call) else str(error)
    print(f"{command}: {code.name}: {details}", file=sys.stderr)
    return 3 if code is grpc.StatusCode.UNAVAILABLE else 1


def _publish(args: argparse.Namespace, key: str) -> int:
    missing = [
        flag
        for flag, value in (
            ("--model", args.model),
            ("--population", args.population),
            ("--score", args.score),
            ("--samples", args.samples),
            ("--owner", args.owner),
        )
        if value is None
    ]
    if args.review_by is None and args.max_age_days is None:
        missing.append("--review-by or --max-age-days")
    if missing:
        print(f"evidence publish: missing {', '.join(missing)}", file=sys.stderr)
        return 2
    try:
        evaluated_at = parse_time(args.evaluated_at) if args.evaluated_at else 0.0
        review_by = parse_time(args.review_by) if args.review_by else 0.0
    except ValueError as error:
        print(f"evidence publish: {error}", file=sys.stderr)
        return 2
    recorded = publish_evidence(
        args.address,
        key,
        model=args.model,
        population=args.population,
        score=args.score,
        samples=args.samples,
        owner=args.owner,
        version=args.version,
        output_cap=args.output_cap,
        evaluated_at=evaluated_at,
        review_by=review_by,
        max_age_s=args.max_age_days * DAY_S if args.max_age_days is not None else 0.0,
        ca=args.ca,
    )
    print(
        f"published {recorded.model} v{recorded.version} on {recorded.population}"
        f"{f' (output cap {recorded.output_cap})' if recorded.output_cap else ''}: score {recorded.score:g}, "
        f"{recorded.sample_size} samples, owner {recorded.owner}, evaluated {_date(recorded.evaluated_at)}"
    )
    return 0


def _list(args: argparse.Namespace, key: str) -> int:
    data = listing_json(list_evidence(args.address, key, ca=args.ca))
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print("evidence:")
    for e in data["evidence"]:
        cap = f" cap={e['output_cap']}" if e["output_cap"] else ""
        expiry = e["review_by"] or (f"{e['max_age_days']:g} days" if e["max_age_days"] else "never")
        print(
            f"  {e['model']} v{e['version']} {e['population']}{cap}: score {e['score']:g} "
            f"n={e['sample_size']} owner={e['owner'] or '-'} evaluated={e['evaluated_at'] or 'undated'} "
            f"expires={expiry} ({e['source']})"
        )
    print("routes:")
    for r in data["routes"]:
        print(
            f"  {r['route']} {r['degradation']}: {r['status']} (floor {r['floor']:g}; "
            f"evidence {r['model']} v{r['version']} {r['population']}"
            f"{' cap=' + str(r['output_cap']) if r['output_cap'] else ''})"
        )
    return 0
