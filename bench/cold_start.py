"""A (re)started Triton's first executions: cold or warm?

Starts ``LocalTriton`` on a copy of the example repository's ``full-v18`` and ``compact-v11``
(at ``--time-factor``), sends ``--rounds`` rounds of ``-n`` concurrent ``full-v18`` calls
(``INPUT_IDS`` ``[1, --tokens]``, the model's default 64 output tokens) straight to Triton,
then SIGKILLs the server, starts it again (``LocalTriton.kill()``/``start()``, as
``bench/surge.py``'s kill run does) and sends the same rounds to the new server. Per round:
the client's latencies (min/median/max) and statuses, the batches Triton formed, and the
**excess over the cost model**: Triton's ``compute_infer`` per request minus what the emulator's
cost model gives for the batches Triton formed (``fixed_ms + prefill_ms_per_token x batch x
tokens + decode_ms_per_token x 64``, x the time factor), from the statistics before and after
the round. A warm instance's excess is the emulator's own overhead (~1-3 ms); an instance's
cold first execution adds ~20-25 ms to it (docs/bench-logs/cold-start.txt: 19.9-25.2).

``--no-warmup`` removes the models' ``model_warmup`` block from the copy: the repository as it
was before Triton's warm-up was configured, to compare in one command::

    python bench/cold_start.py --no-warmup            # before: cold first executions
    python bench/cold_start.py                        # the example repository as shipped
    python bench/cold_start.py --time-factor 0 -n 1   # one call at a time: each instance's first

Everything it starts is killed on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

from gateway.backends.local import LocalTriton
from orchid_tools.capacity_prefix import model_parameters

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "orchid"
MODEL = "full-v18"
MODELS = ("full-v18", "compact-v11")
WARMUP_BLOCK = re.compile(r"^model_warmup \[.*?^\]\n", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Counters:
    batches: dict[int, int]  # batch size -> executions of that size
    requests: int
    compute_infer_ns: int

    @classmethod
    def read(cls, reply: service_pb2.ModelStatisticsResponse) -> Counters:
        stats = reply.model_stats[0]
        return cls(
            {int(b.batch_size): int(b.compute_infer.count) for b in stats.batch_stats},
            int(stats.inference_stats.success.count),
            int(stats.inference_stats.compute_infer.ns),
        )


def repository(into: Path, *, warmup: bool) -> Path:
    """A copy of the two models (and the emulator they import); without ``model_warmup``
    blocks unless ``warmup``."""
    repo = into / "repo" / "model_repository"
    for model in MODELS:
        shutil.copytree(EXAMPLES / "model_repository" / model, repo / model)
        if not warmup:
            config = repo / model / "config.pbtxt"
            text, count = WARMUP_BLOCK.subn("", config.read_text())
            if count != 1:
                raise SystemExit(f"{config}: expected one model_warmup block, found {count}")
            config.write_text(text)
    shutil.copytree(EXAMPLES / "emulator", into / "repo" / "emulator")
    return repo


def request(tokens: int) -> service_pb2.ModelInferRequest:
    req = service_pb2.ModelInferRequest(model_name=MODEL)
    tensor = req.inputs.add(name="INPUT_IDS", datatype="INT32")
    tensor.shape.extend([1, tokens])
    req.raw_input_contents.append(np.arange(tokens, dtype=np.int32).tobytes())
    return req


def batch_ms(params: dict[str, str], size: int, tokens: int, time_factor: float) -> float:
    """The cost model's time of one batch of ``size`` requests of ``tokens`` input tokens."""
    return time_factor * (
        float(params["fixed_ms"])
        + float(params["prefill_ms_per_token"]) * size * tokens
        + float(params["decode_ms_per_token"]) * int(params["default_max_output_tokens"])
    )


async def rounds(address: str, label: str, args: argparse.Namespace, params: dict[str, str]) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        await stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=5.0)  # connected first

        async def counters() -> Counters:
            reply = await stub.ModelStatistics(service_pb2.ModelStatisticsRequest(name=MODEL), timeout=5.0)
            return Counters.read(reply)

        async def one() -> tuple[float, str]:
            start = time.perf_counter()
            try:
                await stub.ModelInfer(request(args.tokens), timeout=10.0)
                code = "OK"
            except grpc.aio.AioRpcError as error:
                code = error.code().name
            return (time.perf_counter() - start) * 1000.0, code

        for k in range(1, args.rounds + 1):
            before = await counters()
            results = await asyncio.gather(*(one() for _ in range(args.n)))
            after = await counters()
            batches = {
                size: after.batches[size] - before.batches.get(size, 0)
                for size in sorted(after.batches)
                if after.batches[size] != before.batches.get(size, 0)
            }
            requests = max(1, after.requests - before.requests)
            model_ns = sum(
                size * count * batch_ms(params, size, args.tokens, args.time_factor) * 1e6
                for size, count in batches.items()
            )
            excess_ms = (after.compute_infer_ns - before.compute_infer_ns - model_ns) / requests / 1e6
            latencies = sorted(ms for ms, _ in results)
            median = latencies[len(latencies) // 2]
            codes = Counter(code for _, code in results)
            print(
                f"{label} round {k}: client ms min {latencies[0]:.1f} median {median:.1f} "
                f"max {latencies[-1]:.1f} {dict(codes)}; Triton batches {batches}; "
                f"excess over the cost model {excess_ms:.1f} ms/request",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--time-factor", type=float, default=1.0, help="ORCHID_TIME_FACTOR (default 1)")
    parser.add_argument("-n", type=int, default=8, help="concurrent calls per round (default 8)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per server (default 3)")
    parser.add_argument("--tokens", type=int, default=64, help="input tokens per call (default 64)")
    parser.add_argument("--restarts", type=int, default=1, help="kill + restart cycles (default 1)")
    parser.add_argument(
        "--no-warmup", action="store_true", help="remove the models' model_warmup blocks from the copy"
    )
    args = parser.parse_args()
    params = model_parameters(EXAMPLES / "model_repository", MODEL)
    work = Path(tempfile.mkdtemp(prefix="orchid-cold-start-"))
    repo = repository(work, warmup=not args.no_warmup)
    print(
        f"{MODEL} at time factor {args.time_factor:g}, {args.n} concurrent calls a round, "
        f"model_warmup {'removed' if args.no_warmup else 'as shipped'}"
    )
    triton = LocalTriton(repo, work / "triton", time_factor=args.time_factor)
    try:
        started = time.monotonic()
        triton.start()
        print(f"started: ready after {time.monotonic() - started:.1f} s")
        asyncio.run(rounds(triton.address, "first server", args, params))
        for r in range(1, args.restarts + 1):
            triton.kill()
            started = time.monotonic()
            triton.start()
            print(f"killed and started again ({r}): ready after {time.monotonic() - started:.1f} s")
            asyncio.run(rounds(triton.address, f"restart {r}", args, params))
    finally:
        triton.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
