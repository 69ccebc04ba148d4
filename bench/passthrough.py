"""The floor: a bare ``grpc.aio`` pass-through proxy for Triton's ``ModelInfer``.

It registers one generic handler for ``/inference.GRPCInferenceService/ModelInfer``
with no serializers on either side, so request and response bytes are forwarded
untouched over one ``grpc.aio`` channel to Triton: no protobuf parsing, no
authentication, no admission. Whatever a Python gateway built on ``grpc.aio`` costs
above this is its own work; this is what the gRPC stack alone costs
(ARCHITECTURE §7). Upstream errors are passed back with their status code and
details; the caller's deadline, if any, is propagated.

With ``--parse`` it is the floor of a proxy that *reads* the call: the request is
parsed into a ``ModelInferRequest`` and serialized again towards Triton, and the
response parsed and serialized again towards the caller (grpc.aio's own protobuf
(de)serializers on both sides), still with no other work. Any gateway that looks at the
tensors pays at least this; the difference to the raw pass-through is what parsing and
re-serializing cost in grpc.aio.

    python bench/passthrough.py --listen 127.0.0.1:19411 --upstream 127.0.0.1:19410
    python bench/passthrough.py --listen 127.0.0.1:19413 --upstream 127.0.0.1:19410 --parse

Prints ``passthrough ready on HOST:PORT`` once listening; stops on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Awaitable, Callable

import grpc
from tritonclient.grpc import service_pb2

METHOD = "/inference.GRPCInferenceService/ModelInfer"
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


class PassThrough(grpc.GenericRpcHandler):  # type: ignore[misc]  # grpc is untyped
    """Forwards raw ModelInfer bytes to one upstream channel."""

    def __init__(self, channel: grpc.aio.Channel, *, parse: bool = False) -> None:
        if parse:  # messages both ways, as a stub and a servicer would have them
            self._upstream: Callable[..., Awaitable[bytes]] = channel.unary_unary(
                METHOD,
                request_serializer=service_pb2.ModelInferRequest.SerializeToString,
                response_deserializer=service_pb2.ModelInferResponse.FromString,
            )
            self._handler = grpc.unary_unary_rpc_method_handler(
                self._forward,
                request_deserializer=service_pb2.ModelInferRequest.FromString,
                response_serializer=service_pb2.ModelInferResponse.SerializeToString,
            )
        else:  # no serializers: the callable takes and returns ``bytes``
            self._upstream = channel.unary_unary(METHOD)
            self._handler = grpc.unary_unary_rpc_method_handler(self._forward)

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if handler_call_details.method == METHOD:
            return self._handler
        return None

    async def _forward(self, request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        remaining = context.time_remaining()
        try:
            return await self._upstream(request, timeout=remaining)
        except grpc.aio.AioRpcError as error:
            await context.abort(error.code(), error.details() or "")
            raise  # unreachable: abort raises


async def serve(listen: str, upstream: str, *, parse: bool = False) -> None:
    options = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ]
    channel = grpc.aio.insecure_channel(upstream, options=options)
    server = grpc.aio.server(options=options)
    server.add_generic_rpc_handlers((PassThrough(channel, parse=parse),))
    port = server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    host = listen.rsplit(":", 1)[0]
    print(f"passthrough ready on {host}:{port}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop(grace=1.0)
        await channel.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--listen", required=True, help="HOST:PORT to listen on")
    parser.add_argument("--upstream", required=True, help="HOST:PORT of Triton's gRPC endpoint")
    parser.add_argument(
        "--parse", action="store_true", help="parse and re-serialize both messages (the reading floor)"
    )
    args = parser.parse_args(argv)
    asyncio.run(serve(args.listen, args.upstream, parse=args.parse))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
