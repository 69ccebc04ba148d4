"""``orchid-gateway devices status|lost|back``: a topology's devices through the gateway's admin
RPC (``orchid.admin.v1.GatewayAdmin/TopologyStatus``, ``SetDevicesLost``).

Marking a device lost (a health agent seeing an XID error, an operator draining a host) takes
every unit that spans it out of its pool at once: no new work binds there and the ladder's
protected capacity drops by the whole unit (dispatch rule 10, ``gateway.core.units``). ``back``
returns them. ``status`` prints each backend's lost devices and each pool's units. The admin key
comes from ``--key`` or ``ORCHID_ADMIN_KEY``; the gateway is reached at ``--address``
(plaintext, or TLS with ``--ca``), as ``orchid-gateway evidence`` does.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import grpc

from gateway._proto import admin_pb2
from gateway.core.topology import TopologyError, parse_devices
from orchid_tools.evidence import KEY_ENV, _call, _channel, admin_key, refused


def topology_status(
    address: str, key: str, *, ca: str | None = None, timeout_s: float = 10.0
) -> admin_pb2.TopologyStatusResponse:
    with _channel(address, ca) as channel:
        reply: admin_pb2.TopologyStatusResponse = _call(
            channel,
            "TopologyStatus",
            admin_pb2.TopologyStatusRequest(),
            admin_pb2.TopologyStatusResponse,
            key,
            timeout_s,
        )
    return reply


def set_devices_lost(
    address: str,
    key: str,
    backend: str,
    devices: tuple[int, ...],
    *,
    lost: bool,
    ca: str | None = None,
    timeout_s: float = 10.0,
) -> admin_pb2.TopologyStatusResponse:
    """Mark ``devices`` of ``backend`` lost (or back); the topology's state after it. Raises
    ``grpc.RpcError`` on refusal."""
    request = admin_pb2.SetDevicesLostRequest(backend=backend, devices=list(devices), lost=lost)
    with _channel(address, ca) as channel:
        reply: admin_pb2.TopologyStatusResponse = _call(
            channel, "SetDevicesLost", request, admin_pb2.TopologyStatusResponse, key, timeout_s
        )
    return reply


def status_json(reply: admin_pb2.TopologyStatusResponse) -> dict[str, Any]:
    return {
        "backends": [
            {
                "backend": b.backend,
                "devices": b.devices,
                "lost": list(b.lost),
                "pools": [
                    {
                        "pool": p.pool,
                        "width": p.width,
                        "capacity_devices": p.capacity_devices,
                        "units": [
                            {"name": u.name, "devices": list(u.devices), "available": u.available}
                            for u in p.units
                        ],
                    }
                    for p in b.pools
                ],
            }
            for b in reply.backends
        ]
    }


def _unit_json(unit: admin_pb2.TopologyUnit) -> dict[str, Any]:
    return {"name": unit.name, "devices": list(unit.devices), "available": unit.available}


def render(reply: admin_pb2.TopologyStatusResponse) -> str:
    if not reply.backends:
        return "no backend declares a topology"
    lines = []
    for b in reply.backends:
        lost = ", ".join(str(d) for d in b.lost) or "none"
        lines.append(f"backend {b.backend}: {b.devices} devices; lost: {lost}")
        for p in b.pools:
            units = "; ".join(
                f"{u.name.rsplit('/', 1)[-1]} [{', '.join(str(d) for d in u.devices)}]"
                + ("" if u.available else " LOST")
                for u in p.units
            )
            lines.append(f"  {p.pool}: width {p.width}, capacity {p.capacity_devices} devices: {units}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("status", "lost", "back"), help="show, mark lost, or mark back")
    parser.add_argument("devices", nargs="?", default="", help='lost/back: devices, e.g. "3" or "2-3,6"')
    parser.add_argument("--backend", default="local", help="lost/back: the backend (default: local)")
    parser.add_argument("--address", default="127.0.0.1:8001", help="the gateway's gRPC address")
    parser.add_argument("--key", default=None, help=f"admin key (default: ${KEY_ENV})")
    parser.add_argument("--ca", default=None, help="CA certificate (PEM) for a TLS gateway")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    key = admin_key(args, "devices")
    if not key:
        return 2
    try:
        if args.action == "status":
            reply = topology_status(args.address, key, ca=args.ca)
        else:
            try:
                devices = parse_devices(args.devices)
            except (TopologyError, ValueError):
                devices = ()
            if not devices:
                print(
                    f'devices {args.action}: name the devices, e.g. "3" or "2-3" (got {args.devices!r})',
                    file=sys.stderr,
                )
                return 2
            reply = set_devices_lost(
                args.address, key, args.backend, devices, lost=args.action == "lost", ca=args.ca
            )
    except grpc.RpcError as error:
        return refused(f"devices {args.action}", error)
    print(json.dumps(status_json(reply), indent=2) if args.json else render(reply))
    return 0
