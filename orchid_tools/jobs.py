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
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import grpc
from google.protobuf.json_format import MessageToDict
from tritonclient.grpc import service_pb2

from gateway._proto import jobs_pb2, jobs_pb2_grpc
from gateway.core.errors import InvalidArgument
from gateway.jobs.batch import request_from_json, response_json

KEY_ENV = "ORCHID_API_KEY"
DONE = frozenset({"completed", "failed", "expired", "cancelled"})


BAR_WIDTH = 30


def progress_line(done: int, total: int, elapsed_s: float, since: int = 0) -> str:
    """``[#####.....] 300/1000 250.0/s ETA 3s``: the rate and the ETA count only the items done
    since the watch began (``since`` were done before it)."""
    filled = min(BAR_WIDTH, int(BAR_WIDTH * done / total)) if total else BAR_WIDTH
    rate = (done - since) / elapsed_s if elapsed_s > 0 else 0.0
    eta = f"{(total - done) / rate:.0f}s" if rate > 0 else "?"
    return f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {done}/{total} {rate:.1f}/s ETA {eta}"


class Progress:
    """An operation's progress on ``stream``. On a terminal, one bar redrawn in place at every
    update; on anything else (a log, a pipe), a line only when the status changes or another
    tenth of the items is done, so the output stays bounded (at most ~12 lines per operation)."""

    def __init__(self, stream: TextIO, *, label: str = "", tty: bool | None = None) -> None:
        self.stream = stream
        self.label = label
        self.tty = stream.isatty() if tty is None else tty
        self._started = time.monotonic()
        self._since: int | None = None
        self._last: tuple[str, int] | None = None
        self._drawn = False

    def line(self, status: str, done: int, total: int, suffix: str = "") -> str:
        if self._since is None:
            self._since = done
        bar = progress_line(done, total, time.monotonic() - self._started, self._since)
        return f"{self.label}{bar} {status}{suffix}"

    def update(self, status: str, done: int, total: int, suffix: str = "") -> None:
        text = self.line(status, done, total, suffix)
        if self.tty:
            self.stream.write(f"\r{text}\x1b[K")
            self._drawn = True
        else:
            tenth = 10 * done // total if total else 10
            if self._last is not None and self._last == (status, tenth):
                return
            self._last = (status, tenth)
            self.stream.write(text + "\n")
        self.stream.flush()

    def update_from(self, op: jobs_pb2.Operation, suffix: str = "") -> None:
        self.update(op.status, op.counts.completed + op.counts.failed, op.counts.total, suffix)

    def close(self) -> None:
        if self.tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
        self._drawn = False


def follow(client: Client, op_id: str, progress: Progress) -> jobs_pb2.Operation | None:
    """Show ``op_id``'s progress until it is done; its last state (None: no update came)."""
    last = None
    try:
        for last in client.wait(op_id):
            progress.update_from(last)
    finally:
        progress.close()
    return last


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
    for name, what in (
        ("get", "show an operation"),
        ("wait", "show an operation's progress (stderr) until it is done; then its status (stdout)"),
        ("cancel", "cancel an operation"),
    ):
        one = sub.add_parser(name, help=what)
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
            last = follow(client, args.id, Progress(sys.stderr))
            if last is None:
                return 1
            counts = last.counts
            print(f"{last.status} {counts.completed + counts.failed}/{counts.total}", flush=True)
            return 0 if last.status == "completed" else 1
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
