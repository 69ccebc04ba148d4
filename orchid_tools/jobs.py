"""``orchid-gateway jobs submit|get|wait|cancel|list``: asynchronous inference through the
gateway's ``orchid.jobs.v1.Operations`` service.

Client commands: the gateway is reached at ``--target HOST:PORT`` (plaintext, or TLS with
``--ca``) and the credential is read from ``ORCHID_API_KEY`` (the same bearer key as the
inference service). ``jobs submit`` takes one KServe v2 JSON inference request body (a
file, or ``-`` for stdin). Exit codes: 0 done (``wait``: completed), 1 the gateway refused
or the operation did not complete, 2 usage (no key, bad file), 3 the gateway could not be
reached. The helpers here are shared with ``orchid-gateway batch`` (``orchid_tools.batch``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from tritonclient.grpc import service_pb2

from gateway._proto import jobs_pb2, jobs_pb2_grpc
from gateway.core.errors import InvalidArgument
from gateway.jobs.batch import request_from_json, response_json

KEY_ENV = "ORCHID_API_KEY"
DONE = frozenset({"completed", "failed", "expired", "cancelled"})


class UsageError(Exception):
    """Exit 2: the command cannot be run as given."""


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target", default="127.0.0.1:8001", help="gateway HOST:PORT (default 127.0.0.1:8001)"
    )
    parser.add_argument("--ca", help="CA certificate for TLS (default: plaintext)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per call (default 30)")


class Client:
    """A stub with the credential from ``ORCHID_API_KEY``."""

    def __init__(self, args: argparse.Namespace) -> None:
        key = os.environ.get(KEY_ENV, "").strip()
        if not key:
            raise UsageError(f"set {KEY_ENV} to the API key of the tenant the jobs belong to")
        if args.ca:
            credentials = grpc.ssl_channel_credentials(Path(args.ca).read_bytes())
            self.channel = grpc.secure_channel(args.target, credentials)
        else:
            self.channel = grpc.insecure_channel(args.target)
        self.stub = jobs_pb2_grpc.OperationsStub(self.channel)  # type: ignore[no-untyped-call]
        self.metadata = (("authorization", f"Bearer {key}"),)
        self.timeout = args.timeout

    def get(self, op_id: str) -> jobs_pb2.Operation:
        reply: jobs_pb2.Operation = self.stub.Get(
            jobs_pb2.GetRequest(id=op_id), metadata=self.metadata, timeout=self.timeout
        )
        return reply

    def wait(self, op_id: str, timeout_s: float | None = None) -> Iterator[jobs_pb2.Operation]:
        """Status changes until the operation is done (reconnecting when a stream's bound ends)."""
        while True:
            last = None
            for last in self.stub.Wait(
                jobs_pb2.GetRequest(id=op_id), metadata=self.metadata, timeout=timeout_s
            ):
                yield last
            if last is not None and last.status in DONE:
                return

    def close(self) -> None:
        self.channel.close()


def operation_dict(op: jobs_pb2.Operation) -> dict[str, Any]:
    """An operation as JSON: its fields, and the result decoded as a KServe v2 JSON body."""
    out: dict[str, Any] = MessageToDict(
        op, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    out.pop("infer_response", None)
    if op.infer_response:
        out["response"] = response_json(service_pb2.ModelInferResponse.FromString(op.infer_response))
    return out


def read_body(path: str) -> Any:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
        return json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UsageError(f"cannot read a JSON request from {path}: {error}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="jobs_command", required=True)
    submit = sub.add_parser("submit", help="durably submit one inference request; prints the operation")
    submit.add_argument("--model", required=True)
    submit.add_argument("--request", required=True, help="KServe v2 JSON request body file (- for stdin)")
    submit.add_argument(
        "--class", dest="request_class", default="", help="job class (default: the gateway's)"
    )
    submit.add_argument("--operation-id", default="", help="idempotency key")
    submit.add_argument("--complete-within", type=float, default=0.0, help="seconds (default: the gateway's)")
    submit.add_argument("--wait", action="store_true", help="wait until done and print the result")
    for name in ("get", "wait", "cancel"):
        one = sub.add_parser(name, help=f"{name} an operation")
        one.add_argument("id")
        add_client_arguments(one)
    listing = sub.add_parser("list", help="your operations, newest first")
    listing.add_argument("--status", default="")
    listing.add_argument("--kind", default="", choices=["", "async", "batch"])
    listing.add_argument("--page-size", type=int, default=20)
    listing.add_argument("--page-token", default="")
    add_client_arguments(listing)
    add_client_arguments(submit)


def _print(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True))


def run(args: argparse.Namespace) -> int:
    return guarded(_run, args)


def guarded(fn: Any, args: argparse.Namespace) -> int:
    """Run a client command; map a refusal or an unreachable gateway to its exit code."""
    try:
        return int(fn(args))
    except UsageError as error:
        print(f"orchid-gateway: {error}", file=sys.stderr)
        return 2
    except InvalidArgument as error:
        print(f"orchid-gateway: {error.message}", file=sys.stderr)
        return 2
    except grpc.RpcError as error:
        code = error.code() if hasattr(error, "code") else None
        details = error.details() if hasattr(error, "details") else str(error)
        print(f"orchid-gateway: {code.name if code else 'ERROR'}: {details}", file=sys.stderr)
        return 3 if code is grpc.StatusCode.UNAVAILABLE else 1


def _run(args: argparse.Namespace) -> int:
    client = Client(args)
    try:
        if args.jobs_command == "submit":
            request = request_from_json(read_body(args.request), args.model, "request")
            op = client.stub.Submit(
                jobs_pb2.SubmitRequest(
                    infer_request=request.SerializeToString(),
                    request_class=args.request_class,
                    operation_id=args.operation_id,
                    complete_within_s=args.complete_within,
                ),
                metadata=client.metadata,
                timeout=client.timeout,
            )
            if args.wait:
                for _update in client.wait(op.id):
                    pass
                op = client.get(op.id)
                _print(operation_dict(op))
                return 0 if op.status == "completed" else 1
            _print(operation_dict(op))
            return 0
        if args.jobs_command == "get":
            _print(operation_dict(client.get(args.id)))
            return 0
        if args.jobs_command == "wait":
            last = None
            for last in client.wait(args.id):
                counts = last.counts
                print(f"{last.status} {counts.completed + counts.failed}/{counts.total}", flush=True)
            return 0 if last is not None and last.status == "completed" else 1
        if args.jobs_command == "cancel":
            op = client.stub.Cancel(
                jobs_pb2.GetRequest(id=args.id), metadata=client.metadata, timeout=client.timeout
            )
            _print(operation_dict(op))
            return 0
        reply = client.stub.List(
            jobs_pb2.ListRequest(
                status=args.status, kind=args.kind, page_size=args.page_size, page_token=args.page_token
            ),
            metadata=client.metadata,
            timeout=client.timeout,
        )
        _print(
            {
                "operations": [operation_dict(op) for op in reply.operations],
                "next_page_token": reply.next_page_token,
            }
        )
        return 0
    finally:
        client.close()
