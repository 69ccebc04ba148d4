"""Capacity emulator for the Orchid teaching fixture (Triton Python backend).

This is NOT a model. On a CPU-only development machine it stands in for an
accelerator replica: each Triton model instance is one "device", and executing
a batch *holds that instance* for the time the seed's cost model gives, so the
gateway meets real queueing, real backpressure and real Triton statistics.
Outputs are deterministic functions of the inputs so tests can compare tensors
returned through the gateway with tensors returned by Triton directly.

Cost model (per batch, milliseconds, before the time factor):

    fixed_ms + prefill_ms_per_token * (batch_size * longest_input)   # padded prefill
             + decode_ms_per_token * longest_output                  # decode steps run in lockstep

A batch of one reproduces the seed's per-request figures. Prefill is charged on
the *padded* shape (compute-bound), decode once per step for the whole batch
(memory-bound), which is why mixing a 4,096-token input with 256-token inputs
is expensive and batching equal short shapes is cheap.

Environment:
    ORCHID_TIME_FACTOR   multiplies every sleep (tests use ~0.05; default 1.0); a model's
                         optional config parameter ``time_factor_scale`` multiplies it again
                         for that model alone (a slower candidate version, for rollout tests)

Bad candidate versions (optional model config parameters, for rehearsing rollouts):
    slow_long_input_tokens, slow_long_scale
                         a batch whose longest input is over ``slow_long_input_tokens`` runs
                         ``slow_long_scale`` times slower (correct, but slow only on long inputs)
    invalid_output_after, invalid_output_every
                         after its first ``invalid_output_after`` executions, every
                         ``invalid_output_every``-th execution answers out-of-range tokens
                         (``VOCAB`` and above: a drifting version whose answers are invalid)
    ORCHID_FAULT_DIR     optional: forced allocation failures, for rehearsing a version
                         change. A file ``<model>.fail_load`` there makes loading that model
                         fail with ``CUDA out of memory`` (Triton reports the load failed); a
                         file ``<model>.fail_execute`` holding a number N makes every execution
                         of it after its first N fail the same way (0: from the first). Read at
                         load (fail_load) and at each execution (fail_execute).
    ORCHID_DEVICE_DIR    optional: emulate a fleet shared by several models. Every
                         model's instances then execute on ORCHID_DEVICES (default 4)
                         emulated devices, one lock file each in this directory: a
                         batch runs on its own instance's device (instance index mod
                         devices) if that is free, else on whichever frees first (polled
                         every 0.5 ms). As if every model were resident on every
                         device and each batch were placed on a free one; used to put
                         the fallback model on the primary's devices, as the seed
                         models it. (With strict instance-to-GPU pinning, Triton's
                         choice of instance would add contention nobody predicts.)

Device memory (optional model config parameters, all four together):

    device_memory_gib           memory of the device each instance stands for
    runtime_reserve_gib         runtime/workspace/allocator reserve on it
    weights_bytes               this model's resident weights
    live_cache_bytes_per_token  live sequence state per token

A batch's live state is ``live_cache_bytes_per_token x rows x (longest input + longest
output)`` (padded, like its prefill). When it exceeds what the device has left beside the
reserve and the weights, the execution fails at once the way an allocation failure does on
a GPU: every request of the batch gets an error response ``CUDA out of memory. Tried to
allocate ...`` (also written to Triton's log as an error) and the device is free again. A
batch of one that fits runs as before: the limit bites when Triton co-batches requests that
do not fit together, or when one request alone exceeds the device. The same numbers are the
gateway's live-memory bound (the route's profile, the backend's ``device_memory_gib`` and
``runtime_reserve_gib``). Weights beside the reserve that exceed the device fail the load.

Features (optional input ``FEATURES``, TYPE_FP32; the ``ranker-v3`` model declares it): a
request that carries it gets it back, as float32, in the output ``FEATURES_SEEN`` beside
``OUTPUT_IDS``, so a test can prove which features reached the model. They change neither the
tokens nor the cost. A request without it (and every model without the input) answers as before;
one batch may mix both.

Cancellation: decode runs in steps; between steps the emulator checks
`request.is_cancelled()` and stops decoding a cancelled request, which frees
the instance early exactly as a real server frees a slot.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

import numpy as np
import triton_python_backend_utils as pb_utils  # type: ignore[import-not-found]

VOCAB = 32_000
GIB = 1024**3
MIB = 1024**2
# Sleep granularity while decoding: short enough to notice a cancel promptly,
# long enough that the stub is not busy-looping.
_STEP_SLICE_S = 0.010
# How often a batch waiting for a shared device (ORCHID_DEVICE_DIR) looks for a free one.
_DEVICE_POLL_S = 0.0005


@dataclass(frozen=True)
class CostProfile:
    fixed_ms: float
    prefill_ms_per_token: float
    decode_ms_per_token: float
    default_max_output_tokens: int

    @classmethod
    def from_model_config(cls, config: dict) -> CostProfile:
        params = config.get("parameters", {})

        def value(key: str) -> str:
            try:
                return str(params[key]["string_value"])
            except KeyError as exc:
                raise pb_utils.TritonModelException(f"model config parameter {key!r} is required") from exc

        return cls(
            fixed_ms=float(value("fixed_ms")),
            prefill_ms_per_token=float(value("prefill_ms_per_token")),
            decode_ms_per_token=float(value("decode_ms_per_token")),
            default_max_output_tokens=int(value("default_max_output_tokens")),
        )


@dataclass(frozen=True)
class DeviceMemory:
    """The device an instance stands for: its memory, and what a batch's live state may use."""

    device_bytes: int
    reserve_bytes: int
    weights_bytes: int
    live_cache_bytes_per_token: int

    KEYS = ("device_memory_gib", "runtime_reserve_gib", "weights_bytes", "live_cache_bytes_per_token")

    @classmethod
    def from_model_config(cls, config: dict) -> DeviceMemory | None:
        params = config.get("parameters", {})
        present = [key for key in cls.KEYS if key in params]
        if not present:
            return None
        if len(present) != len(cls.KEYS):
            missing = ", ".join(key for key in cls.KEYS if key not in params)
            raise pb_utils.TritonModelException(f"device memory parameters need all four; missing {missing}")

        def value(key: str) -> float:
            return float(params[key]["string_value"])

        memory = cls(
            device_bytes=round(value("device_memory_gib") * GIB),
            reserve_bytes=round(value("runtime_reserve_gib") * GIB),
            weights_bytes=round(value("weights_bytes")),
            live_cache_bytes_per_token=round(value("live_cache_bytes_per_token")),
        )
        if memory.live_room_bytes < 0:
            raise pb_utils.TritonModelException(
                f"CUDA out of memory loading weights: {memory.weights_bytes / GIB:.2f} GiB beside "
                f"a {memory.reserve_bytes / GIB:.2f} GiB reserve on a "
                f"{memory.device_bytes / GIB:.2f} GiB device"
            )
        return memory

    @property
    def live_room_bytes(self) -> int:
        return self.device_bytes - self.reserve_bytes - self.weights_bytes

    def allocation_error(self, rows: int, longest_in: int, longest_out: int) -> str | None:
        """The allocation failure a batch of ``rows`` padded to this shape meets, or None."""
        tokens = rows * (longest_in + longest_out)
        need = self.live_cache_bytes_per_token * tokens
        if need <= self.live_room_bytes:
            return None
        return (
            f"CUDA out of memory. Tried to allocate {need / MIB:,.2f} MiB of live sequence state "
            f"({rows} x ({longest_in} + {longest_out}) tokens); device has "
            f"{self.device_bytes / GIB:.2f} GiB total, {self.reserve_bytes / GIB:.2f} GiB reserved, "
            f"{self.weights_bytes / GIB:.2f} GiB weights, {self.live_room_bytes / MIB:,.2f} MiB free"
        )


def output_tokens(input_ids: np.ndarray, count: int) -> np.ndarray:
    """Deterministic 'generated' tokens derived from the input."""
    seed = int(np.asarray(input_ids, dtype=np.int64).sum() % VOCAB)
    steps = np.arange(count, dtype=np.int64)
    return ((seed + 7919 * steps + 17) % VOCAB).astype(np.int32)


def requested_output_tokens(request: object, default: int) -> int:
    raw = request.parameters()  # type: ignore[attr-defined]
    params = json.loads(raw) if raw else {}
    value = params.get("max_output_tokens", default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"parameter max_output_tokens must be a positive integer, got {value!r}")
    return value


def time_factor() -> float:
    raw = os.environ.get("ORCHID_TIME_FACTOR", "1.0")
    factor = float(raw)
    if factor < 0:
        raise ValueError(f"ORCHID_TIME_FACTOR must be >= 0, got {raw!r}")
    return factor


class SharedDevices:
    """Lock files standing for a fleet of devices that several models' instances share."""

    def __init__(self, directory: str, devices: int, instance_name: str) -> None:
        os.makedirs(directory, exist_ok=True)
        match = re.search(r"(\d+)$", instance_name)
        self.own = (int(match.group(1)) if match else 0) % devices
        order = [self.own] + [d for d in range(devices) if d != self.own]
        paths = [os.path.join(directory, f"device-{d}.lock") for d in order]
        self.fds = [os.open(path, os.O_RDWR | os.O_CREAT) for path in paths]

    @classmethod
    def from_env(cls, instance_name: str) -> SharedDevices | None:
        directory = os.environ.get("ORCHID_DEVICE_DIR")
        if not directory:
            return None
        return cls(directory, int(os.environ.get("ORCHID_DEVICES", "4")), instance_name)

    def _try_any(self) -> int | None:
        for fd in self.fds:  # its own device first, then any free one
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            return fd
        return None

    @contextmanager
    def hold(self) -> Iterator[None]:
        held = self._try_any()
        while held is None:  # every device busy: take the first to free
            time.sleep(_DEVICE_POLL_S)
            held = self._try_any()
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


class Faults:
    """Forced allocation failures of one model (``ORCHID_FAULT_DIR``; see the module docstring)."""

    def __init__(self, model: str) -> None:
        directory = os.environ.get("ORCHID_FAULT_DIR", "")
        self.load_file = os.path.join(directory, f"{model}.fail_load") if directory else ""
        self.execute_file = os.path.join(directory, f"{model}.fail_execute") if directory else ""
        self.executions = 0

    def check_load(self) -> None:
        if self.load_file and os.path.exists(self.load_file):
            raise pb_utils.TritonModelException(
                "CUDA out of memory loading weights (forced allocation failure: ORCHID_FAULT_DIR)"
            )

    def execution_error(self) -> str | None:
        """The allocation failure this execution meets, or None (counts the execution)."""
        self.executions += 1
        if not self.execute_file:
            return None
        try:
            with open(self.execute_file, encoding="utf-8") as handle:
                after = int(handle.read().strip() or "0")
        except (OSError, ValueError):
            return None
        if self.executions <= after:
            return None
        return "CUDA out of memory. Tried to allocate live sequence state (forced allocation failure)"


class _Emulator:
    """What both emulators read at load: the cost profile, the time factor, shared devices."""

    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        self.profile = CostProfile.from_model_config(config)
        self.memory = DeviceMemory.from_model_config(config)
        self.faults = Faults(str(config.get("name", args.get("model_name", ""))))
        self.faults.check_load()
        params = config.get("parameters", {})

        def param(key: str, default: str) -> str:
            return str(params.get(key, {}).get("string_value", default))

        self.time_factor = time_factor() * float(param("time_factor_scale", "1"))
        self.slow_long_input_tokens = int(param("slow_long_input_tokens", "0"))
        self.slow_long_scale = float(param("slow_long_scale", "1"))
        self.invalid_output_after = int(param("invalid_output_after", "0"))
        self.invalid_output_every = int(param("invalid_output_every", "0"))
        self.executed = 0
        self.devices = SharedDevices.from_env(str(args.get("model_instance_name", "")))

    def _device(self) -> AbstractContextManager[None]:
        return self.devices.hold() if self.devices else nullcontext()


class BatchEmulator(_Emulator):
    """Non-decoupled model: one response per request, batch held for its cost."""

    def execute(self, requests: list) -> list:
        with self._device():
            return self._execute(requests)

    def _execute(self, requests: list) -> list:
        p = self.profile
        work = []
        responses: list = [None] * len(requests)
        seen: dict[int, np.ndarray] = {}  # request index -> the FEATURES it carried
        for i, request in enumerate(requests):
            try:
                ids = pb_utils.get_input_tensor_by_name(request, "INPUT_IDS").as_numpy()
                n_out = requested_output_tokens(request, p.default_max_output_tokens)
            except ValueError as exc:
                responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc)))
                continue
            features = pb_utils.get_input_tensor_by_name(request, "FEATURES")  # optional input
            if features is not None:
                seen[i] = np.asarray(features.as_numpy(), dtype=np.float32)
            work.append((i, request, ids, n_out))
        forced = self.faults.execution_error() if work else None
        if forced is not None:
            pb_utils.Logger.log_error(forced)
            for i, _, _, _ in work:
                responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(forced))
            work = []
        if work and self.memory is not None:
            rows = sum(ids.shape[0] if ids.ndim == 2 else 1 for _, _, ids, _ in work)
            failure = self.memory.allocation_error(
                rows, max(ids.shape[-1] for _, _, ids, _ in work), max(n for _, _, _, n in work)
            )
            if failure is not None:  # the batch's live state cannot be allocated: all of it fails
                pb_utils.Logger.log_error(failure)
                for i, _, _, _ in work:
                    responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(failure))
                work = []
        if work:
            longest_in = max(ids.shape[-1] for _, _, ids, _ in work)
            slow = 1.0
            if self.slow_long_input_tokens and longest_in > self.slow_long_input_tokens:
                slow = self.slow_long_scale
            self.executed += 1
            every = self.invalid_output_every
            invalid = bool(every) and self.executed > self.invalid_output_after and self.executed % every == 0
            prefill_ms = p.fixed_ms + p.prefill_ms_per_token * len(work) * longest_in
            self._sleep(prefill_ms * slow)
            # Decode steps run in lockstep for the batch; a request leaves the
            # batch when its tokens are done or its caller cancelled.
            step_s = p.decode_ms_per_token * self.time_factor * slow / 1000.0
            start = time.monotonic()
            ends = {i: start + n_out * step_s for i, _, _, n_out in work}
            while ends:
                now = time.monotonic()
                for i, request, _, _ in work:
                    if i in ends and (now >= ends[i] or request.is_cancelled()):
                        del ends[i]
                if ends:
                    time.sleep(min(_STEP_SLICE_S, max(0.0, min(ends.values()) - now)))
            for i, request, ids, n_out in work:
                if request.is_cancelled():
                    responses[i] = pb_utils.InferenceResponse(
                        error=pb_utils.TritonError("request cancelled", pb_utils.TritonError.CANCELLED)
                    )
                    continue
                out = output_tokens(ids, n_out)
                if invalid:
                    out = out + VOCAB  # outside the vocabulary: an invalid answer
                if ids.ndim == 2:  # batched model: [batch, tokens]
                    out = np.tile(out, (ids.shape[0], 1))
                tensors = [pb_utils.Tensor("OUTPUT_IDS", out)]
                if i in seen:  # a model with a FEATURES input answers what it received
                    tensors.append(pb_utils.Tensor("FEATURES_SEEN", seen[i]))
                responses[i] = pb_utils.InferenceResponse(output_tensors=tensors)
        return responses

    def _sleep(self, ms: float) -> None:
        self._sleep_s(ms * self.time_factor / 1000.0)

    @staticmethod
    def _sleep_s(seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


class StreamEmulator(_Emulator):
    """Decoupled model: prefill, then one response per generated token."""

    def execute(self, requests: list) -> None:
        with self._device():
            self._execute(requests)

    def _execute(self, requests: list) -> None:
        p = self.profile
        for request in requests:
            sender = request.get_response_sender()
            try:
                ids = pb_utils.get_input_tensor_by_name(request, "INPUT_IDS").as_numpy()
                n_out = requested_output_tokens(request, p.default_max_output_tokens)
            except ValueError as exc:
                sender.send(
                    pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
                continue
            failure = self.memory.allocation_error(1, ids.shape[-1], n_out) if self.memory else None
            if failure is not None:
                pb_utils.Logger.log_error(failure)
                sender.send(
                    pb_utils.InferenceResponse(error=pb_utils.TritonError(failure)),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
                continue
            tokens = output_tokens(ids, n_out)
            prefill_ms = p.fixed_ms + p.prefill_ms_per_token * ids.shape[-1]
            time.sleep(prefill_ms * self.time_factor / 1000.0)
            step_s = p.decode_ms_per_token * self.time_factor / 1000.0
            start = time.monotonic()
            for k, token in enumerate(tokens, start=1):
                if request.is_cancelled():
                    break
                # Sleep to the token's due time (not a fixed sleep per token), so
                # sub-millisecond steps at small time factors stay accurate overall.
                delay = start + k * step_s - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                sender.send(
                    pb_utils.InferenceResponse(
                        output_tensors=[pb_utils.Tensor("OUTPUT_IDS", np.array([token], dtype=np.int32))]
                    )
                )
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
