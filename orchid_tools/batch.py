"""``orchid-gateway batch submit|get``: batch inference through ``orchid.jobs.v1.Operations``.

``batch submit FILE.jsonl --model MODEL [--wait] [--output DIR]`` sends the JSONL snapshot
(one KServe v2 JSON request body plus ``custom_id`` per line; the gateway validates every
line before it accepts the batch) and prints the operation id; with ``--wait`` it shows a
progress bar on stderr (done/total, rate, ETA; redrawn in place on a terminal, a line per
tenth otherwise) until the batch is done; with ``--output`` it then writes the output set.
``batch get ID [--watch] [--json] [--output DIR]`` shows a batch (the manifest with
``--json``; first its progress until it is done with ``--watch``) and writes its output set.

The output set is the directory ``DIR/ID.vN`` (N: the set's version): ``output.jsonl``, one
line per input line in input order with its ``custom_id``, ``status``, ``response`` (KServe
v2 JSON body with provenance) or ``error``, and ``manifest.json``. Files are mode 0600:
they hold tenant data. Client options and exit codes as in ``orchid_tools.jobs``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from gateway._proto import jobs_pb2
from orchid_tools.jobs import (
    Client,
    Progress,
    UsageError,
    add_client_arguments,
    follow,
    guarded,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="batch_command", required=True)
    submit = sub.add_parser("submit", help="submit a JSONL batch; prints the operation id")
    submit.add_argument("file", type=Path, help="JSONL: one KServe v2 JSON request body + custom_id per line")
    submit.add_argument("--model", required=True)
    submit.add_argument(
        "--class", dest="request_class", default="", help="job class (default: the gateway's)"
    )
    submit.add_argument("--operation-id", default="", help="idempotency key")
    submit.add_argument("--complete-within", type=float, default=0.0, help="seconds (default: the gateway's)")
    submit.add_argument("--wait", action="store_true", help="show progress until the batch is done")
    submit.add_argument("--output", type=Path, help="with --wait: write the output set under this directory")
    add_client_arguments(submit)
    get = sub.add_parser("get", help="show a batch; --json prints its manifest")
    get.add_argument("id")
    get.add_argument("--json", action="store_true", help="print the manifest as JSON")
    get.add_argument("--output", type=Path, help="write the output set under this directory")
    get.add_argument(
        "--watch", action="store_true", help="first show its progress (stderr) until the batch is done"
    )
    add_client_arguments(get)


def run(args: argparse.Namespace) -> int:
    return guarded(_run, args)


def read_output(client: Client, op_id: str) -> tuple[dict[str, Any], list[jobs_pb2.BatchItem]]:
    items: list[jobs_pb2.BatchItem] = []
    manifest: dict[str, Any] | None = None
    token = ""
    while True:
        page = client.stub.ReadBatchOutput(
            jobs_pb2.ReadBatchOutputRequest(id=op_id, page_size=1000, page_token=token),
            metadata=client.metadata,
            timeout=client.timeout,
        )
        if manifest is None:
            manifest = json.loads(page.manifest_json)
        items.extend(page.items)
        token = page.next_page_token
        if not token:
            break
    assert manifest is not None
    return manifest, items


def _private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(text)


def write_output(directory: Path, manifest: dict[str, Any], items: list[jobs_pb2.BatchItem]) -> Path:
    """The output set as files (see the module docstring); returns its directory."""
    target = directory / f"{manifest['id']}.v{manifest.get('output_version', 0)}"
    target.mkdir(parents=True, exist_ok=True, mode=0o700)
    lines = []
    for item in items:
        line: dict[str, Any] = {"custom_id": item.custom_id, "status": item.status, "attempts": item.attempts}
        if item.response_json:
            line["response"] = json.loads(item.response_json)
        if item.error:
            line["error"] = item.error
        line["charged_accelerator_ms"] = item.charged_accelerator_ms
        lines.append(json.dumps(line, sort_keys=True))
    _private(target / "output.jsonl", "\n".join(lines) + ("\n" if lines else ""))
    _private(target / "manifest.json", json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return target


def _run(args: argparse.Namespace) -> int:
    client = Client(args)
    try:
        if args.batch_command == "submit":
            if args.output is not None and not args.wait:
                raise UsageError("--output needs --wait (or use: batch get ID --output DIR)")
            try:
                data = args.file.read_bytes()
            except OSError as error:
                raise UsageError(f"cannot read {args.file}: {error.strerror}") from None
            op = client.stub.SubmitBatch(
                jobs_pb2.SubmitBatchRequest(
                    jsonl=data,
                    model=args.model,
                    request_class=args.request_class,
                    operation_id=args.operation_id,
                    complete_within_s=args.complete_within,
                ),
                metadata=client.metadata,
                timeout=client.timeout,
            )
            print(op.id, flush=True)
            if not args.wait:
                return 0
            follow(client, op.id, Progress(sys.stderr))
            manifest, items = read_output(client, op.id)
            print(_summary(manifest))
            if args.output is not None:
                print(f"output set: {write_output(args.output, manifest, items)}")
            return 0 if manifest["status"] == "completed" else 1
        if args.watch:
            follow(client, args.id, Progress(sys.stderr))
        manifest, items = read_output(client, args.id)
        if args.json:
            print(json.dumps(manifest, indent=2, sort_keys=True))
        else:
            print(_summary(manifest))
        if args.output is not None:
            target = write_output(args.output, manifest, items)
            print(f"output set: {target}", file=sys.stderr if args.json else sys.stdout)
        return 0
    finally:
        client.close()


def _summary(manifest: dict[str, Any]) -> str:
    return (
        f"{manifest['id']} {manifest['status']}: {manifest['completed']}/{manifest['total']} completed, "
        f"{manifest['failed']} failed, {manifest['charged_accelerator_ms']:.1f} accelerator-ms charged"
    )
