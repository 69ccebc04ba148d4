"""``orchid-gateway rollout start|status|promote|rollback|abort FILE_OR_NAME``: drive a version
change through the gateway's admin RPC (``orchid.admin.v1.GatewayAdmin/Rollout*``).

``start`` takes a rollout file (its text is sent and validated by the gateway against its own
routes, errors at ``file:line:col``) or the name of one in the gateway's ``rollouts_dir``; the
other actions take the rollout's name (a file: the name inside it). ``--wait`` polls the
status until the rollout is no longer running and prints its report. The admin key comes from
``--key`` or ``$ORCHID_ADMIN_KEY``. ``rollout_call`` is the function the command calls, for
scripts and tests (``bench/rehearsal.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import grpc

from gateway._proto import admin_pb2
from gateway.yaml_source import YamlError, read_yaml

KEY_ENV = "ORCHID_ADMIN_KEY"
SERVICE = admin_pb2.DESCRIPTOR.services_by_name["GatewayAdmin"].full_name
RUNNING = frozenset({"pending", "loading", "warming", "shadow", "canary", "promoted"})
_METHODS = {
    "start": "RolloutStart",
    "status": "RolloutStatus",
    "promote": "RolloutPromote",
    "rollback": "RolloutRollback",
    "abort": "RolloutAbort",
}


def rollout_call(
    address: str, key: str, action: str, target: str, *, ca: str | None = None, timeout_s: float = 10.0
) -> admin_pb2.RolloutStatusResponse:
    """One admin call; ``target`` is a rollout file or a rollout's name. Raises ``grpc.RpcError``."""
    path = Path(target)
    request: Any
    if action == "start":
        if path.is_file():
            request = admin_pb2.RolloutStartRequest(yaml=path.read_text(encoding="utf-8"), path=str(path))
        else:
            request = admin_pb2.RolloutStartRequest(name=target)
    else:
        name = target
        if path.is_file():
            data = read_yaml(path).value()  # YamlError (located) if it is not YAML
            name = str(data.get("name", "")) if isinstance(data, dict) else ""
        request = admin_pb2.RolloutRequest(name=name)
    channel = (
        grpc.secure_channel(address, grpc.ssl_channel_credentials(Path(ca).read_bytes()))
        if ca
        else grpc.insecure_channel(address)
    )
    with channel:
        rpc = channel.unary_unary(
            f"/{SERVICE}/{_METHODS[action]}",
            request_serializer=lambda message: message.SerializeToString(),
            response_deserializer=admin_pb2.RolloutStatusResponse.FromString,
        )
        reply: admin_pb2.RolloutStatusResponse = rpc(
            request, metadata=(("authorization", f"Bearer {key}"),), timeout=timeout_s
        )
        return reply


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=tuple(_METHODS), help="what to do")
    parser.add_argument("target", metavar="FILE_OR_NAME", help="a rollout file, or a rollout's name")
    parser.add_argument("--address", default="127.0.0.1:8001", help="the gateway's gRPC address")
    parser.add_argument("--key", default=None, help=f"admin key (default: ${KEY_ENV})")
    parser.add_argument("--ca", default=None, help="CA certificate (PEM) for a TLS gateway")
    parser.add_argument("--wait", action="store_true", help="poll until the rollout stops running")
    parser.add_argument("--json", action="store_true", help="print the whole report as JSON")


def _print(reply: admin_pb2.RolloutStatusResponse, as_json: bool) -> None:
    report = json.loads(reply.report_json or "{}")
    if as_json:
        print(json.dumps(report, indent=2))
        return
    print(f"rollout {reply.name}: {reply.phase}" + (f" ({reply.reason})" if reply.reason else ""))
    for at, text in report.get("timeline", []):
        print(f"  {at:8.3f} s  {text}")
    for key in ("load_s", "warm_s", "retired_drain_s", "unload_s", "rewarm_s", "memory_high_water"):
        if report.get(key) is not None:
            print(f"  {key}: {report[key]}")


def run(args: argparse.Namespace) -> int:
    key = args.key or os.environ.get(KEY_ENV, "")
    if not key:
        print(f"rollout: an admin key is needed (--key or ${KEY_ENV})", file=sys.stderr)
        return 2
    try:
        reply = rollout_call(args.address, key, args.action, args.target, ca=args.ca)
        while args.wait and reply.phase in RUNNING:
            time.sleep(0.5)
            reply = rollout_call(args.address, key, "status", reply.name, ca=args.ca)
    except YamlError as error:
        print(f"rollout {args.action}: {error}", file=sys.stderr)
        return 2
    except grpc.RpcError as error:
        code = error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN
        details = error.details() if isinstance(error, grpc.Call) else str(error)
        print(f"rollout {args.action}: {code.name}: {details}", file=sys.stderr)
        return 3 if code is grpc.StatusCode.UNAVAILABLE else 1
    _print(reply, args.json)
    return 1 if reply.phase in ("rolled_back", "aborted") and args.wait else 0
