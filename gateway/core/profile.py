"""Demand profiles: what one execution of a model version costs, as data.

A profile turns a request's shape (input tokens, output tokens, items) into
predicted accelerator-ms by phase and memory by lifetime. It is pure
arithmetic: no clocks, no I/O. Profiles are declared per model version in
``routes/`` (and in capacity worksheets) and corrected online by the
estimator from observed work.

Cost model (milliseconds of one device, batch of ``n`` requests):

    prefill_ms = fixed_ms + prefill_ms_per_token * n * longest_input   # padded: compute-bound
    decode_ms  = decode_ms_per_token * longest_output                  # lockstep: memory-bound

so a batch costs its *padded* shape. For a batch of one this is the seed's
per-request price: full-v18 at 256 input / 64 output tokens is
4.4 + 25.6 + 26.8 = 56.8 accelerator-ms.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

GIB = 1024**3
KIB = 1024


@dataclass(frozen=True, slots=True)
class DemandProfile:
    """Per model version cost and memory profile (validated by ``gateway.settings``)."""

    fixed_ms: float  # launch and fixed host work per batch
    prefill_ms_per_token: float  # main/prefill work per (padded) input token
    decode_ms_per_token: float  # one decode step for the batch
    weights_bytes: int = 0  # resident weights
    workspace_reserve_bytes: int = 0  # runtime/workspace reserve per replica
    live_cache_bytes_per_token: int = 0  # sequence state per live token
    host_cpu_ms: float = 0.0  # gateway/host CPU per request

    def phases(self, input_tokens: int, output_tokens: int, batch: int = 1) -> tuple[float, float]:
        """(prefill_ms, decode_ms) for a batch of ``batch`` requests padded to this shape."""
        prefill = self.fixed_ms + self.prefill_ms_per_token * batch * input_tokens
        decode = self.decode_ms_per_token * output_tokens
        return prefill, decode

    def accelerator_ms(self, input_tokens: int, output_tokens: int) -> float:
        # ``phases`` of one item, inline (called several times per request): x * 1 is x.
        prefill = self.fixed_ms + self.prefill_ms_per_token * input_tokens
        return prefill + self.decode_ms_per_token * output_tokens

    def live_token_ms(self, input_tokens: int, output_tokens: int) -> float:
        """Token-milliseconds of live sequence state: the input is live from prefill to the
        end; generated tokens join one by one, so on average half of them are live in decode."""
        prefill, decode = self.phases(input_tokens, output_tokens)
        return self.live_token_ms_of(input_tokens, output_tokens, prefill, decode)

    @staticmethod
    def live_token_ms_of(input_tokens: int, output_tokens: int, prefill: float, decode: float) -> float:
        """``live_token_ms`` from this shape's ``phases`` (batch of one), when the caller has them."""
        return input_tokens * (prefill + decode) + (output_tokens / 2.0) * decode

    def peak_memory_bytes(self, input_tokens: int, output_tokens: int) -> int:
        return self.live_cache_bytes_per_token * (input_tokens + output_tokens)


@dataclass(frozen=True, slots=True)
class PaddingReport:
    """Useful versus padded token positions of one would-be batch."""

    useful_tokens: int
    padded_tokens: int

    @property
    def amplification(self) -> float:
        return self.padded_tokens / self.useful_tokens if self.useful_tokens else 0.0


def padding(input_tokens: Sequence[int]) -> PaddingReport:
    """Pad every member to the longest: the seed's 7x256 + 1x4096 gives 5,888 useful vs 32,768."""
    if not input_tokens:
        return PaddingReport(0, 0)
    return PaddingReport(sum(input_tokens), max(input_tokens) * len(input_tokens))


def batch_accelerator_ms(profile: DemandProfile, shapes: Sequence[tuple[int, int]]) -> float:
    """Cost of executing ``shapes`` ((input, output) pairs) as one padded batch."""
    if not shapes:
        return 0.0
    longest_in = max(i for i, _ in shapes)
    longest_out = max(o for _, o in shapes)
    prefill, decode = profile.phases(longest_in, longest_out, batch=len(shapes))
    return prefill + decode
