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
                         emulated devices, one lock file each in this directory
                         (``device-<d>.lock``). As if every model were resident on every
                         device and each batch were placed on a free one; used to put
                         the fallback model on the primary's devices, as the seed
                         models it. (With strict instance-to-GPU pinning, Triton's
                         choice of instance would add contention nobody predicts.)
                         Which devices an execution holds: see "Shared devices" below.
    ORCHID_DEVICE_LOG    optional, with ORCHID_DEVICE_DIR: a file to which every execution
                         that held devices appends one JSON line after it ends:
                         ``{"model": name, "devices": [..], "start": t0, "end": t1,
                         "requests": n}`` (``time.time()`` seconds; ``start`` once all its
                         devices were held, ``end`` just before they were released, so two
                         executions sharing a device have disjoint ``[start, end)``).
                         Opened with O_APPEND and written in one ``write`` per line, so the
                         instances' processes do not interleave. For tests.

Shared devices and tensor-parallel units (ORCHID_DEVICE_DIR mode):

    tensor_parallel      optional model config parameter (string int, default "1"): the
                         model is tensor-parallel of degree t, so one execution occupies a
                         *unit* of t devices at once. Its cost profile is then the unit's
                         wall time (see ``full-v18-tp2``). Without ORCHID_DEVICE_DIR it
                         changes nothing: each instance is its own device, as before.
    devices              optional request parameter (a string such as "2,3"): the unit the
                         gateway reserved for the request. Ignored without ORCHID_DEVICE_DIR.

An execution holds all of its devices at once and never starts while only some of them are
free: it tries each device's lock without blocking and, if one is busy, releases those it took
and polls again (every 0.5 ms). It never holds one device while waiting for another, so
executions cannot deadlock. Which devices:

  * If any request of the batch carries ``devices``, the execution holds exactly the union of
    the devices its requests name. Each request's value is checked: comma-separated device
    indices, each within ``0..ORCHID_DEVICES-1``, none twice, exactly t of them for a TP-t
    model; a request that fails the check gets an error response ``parameter devices ...``
    saying why, and the rest of the batch runs without it.
  * Otherwise (a direct client) a TP-t model with t > 1 takes the first free aligned unit:
    devices ``{k*t, ..., k*t+t-1}`` for k = 0, 1, ... below ``ORCHID_DEVICES // t``.
  * A TP-1 model without ``devices`` takes one device, best fit: a free device whose aligned
    TP-2 partner (``d xor 1``) is busy, lost or absent before one whose partner is free (so
    whole pairs stay free for TP-2 units); among equals its own instance's device (instance
    index mod devices) first, then the lowest index. "Busy" is a momentary probe of the
    partner's lock: a heuristic, never a reservation.

Lost devices: a file ``device-<d>.lost`` in ORCHID_DEVICE_DIR marks device d lost (read at each
execution, and again at each poll while waiting). An execution whose ``devices`` name a lost
device fails at once, without holding anything: every request of it gets an error response
``CUDA error: device <d> is lost (...)``. An execution choosing its own unit skips units and
devices with a lost device; if none is left (or the model's t exceeds ORCHID_DEVICES) it fails at
once, every request with ``CUDA error: no unit of <t> device(s) ...``.

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
For a tensor-parallel model (``tensor_parallel`` t) the numbers are those of *each* device of
its unit: each holds 1/t of the weights and of the live state (``full-v18-tp2``).

Features (optional input ``FEATURES``, TYPE_FP32; the ``ranker-v3`` model declares it): a
request that carries it gets it back, as float32, in the output ``FEATURES_SEEN`` beside
``OUTPUT_IDS``, so a test can prove which features reached the model. They change neither the
tokens nor the cost. A request without it (and every model without the input) answers as before;
one batch may mix both.

Prefix cache (optional model config parameters, both together; ``chat-v1``):

    prefix_block_tokens  tokens per cache block (int >= 1)
    prefix_cache_blocks  how many blocks the cache holds (int >= 1)

A model with them keeps a prefix cache *per Triton server and model*, shared by all of its
instances (each instance is a stub process of its own). Each sequence (``INPUT_IDS``: each row
of a ``[rows, n]`` tensor is a sequence of its own) is cut into full blocks of
``prefix_block_tokens`` tokens (a partial tail block is never cached). Block keys are chained, so a
block matches only if its scope and every block before it match::

    k_0 = sha256(scope_utf8 + b"\x00" + tokens_0.astype("<i4").tobytes()).digest()[:16]
    k_i = sha256(k_{i-1} + tokens_i.astype("<i4").tobytes()).digest()[:16]

``scope`` is the request parameter ``prefix_scope`` (a string; absent: ``""``, so a direct
client's requests all share one scope; any other type is an error response naming it). A lookup
counts the leading blocks whose keys are cached (touching them); the sequence's cached tokens are
``cached_blocks x prefix_block_tokens`` capped at ``n - 1`` (one token is always computed).
Then all of the sequence's full blocks are inserted or touched, as if its prefill wrote them,
and while the cache holds more than ``prefix_cache_blocks`` entries the least recently used are
evicted (among blocks touched by the same lookup, the deeper first: a block is useless
without those before it). Prefill is then charged on the uncached tokens only:

    fixed_ms + prefill_ms_per_token * (batch_size * max over rows of (n - cached tokens))

(decode unchanged). Each successful response carries its cached tokens in the output
``PREFIX_CACHED_TOKENS`` (INT32, ``[rows, 1]``: each row's; ``[1]`` for a model without a batch
dimension), which the model must declare (``chat-v1``: ``dims: [ 1 ]``). Not a response
parameter: the Python backend of Triton 2.51 (the nvidia-pytriton wheel) does not accept
``InferenceResponse(parameters=...)``. A model without the parameters runs exactly as before.

    ORCHID_PREFIX_CACHE_DIR   where the cache lives: ``<dir>/<model name>.prefix.sqlite``
                              (SQLite in WAL mode; each lookup and its inserts run in one
                              ``BEGIN IMMEDIATE`` transaction, so the instances' processes never
                              race). ``LocalTriton`` sets it to ``<workdir>/prefix-cache`` and
                              empties that at each start: a fresh server starts cold. Unset, each
                              instance keeps an in-process cache of its own (an in-memory SQLite
                              database, same schema): instances then do not share it.

The SQLite file's schema (tests read it directly; this module imports Triton's utilities):

    CREATE TABLE blocks (key BLOB PRIMARY KEY, last_used INTEGER NOT NULL)  -- 16-byte keys;
        -- last_used: a logical clock, higher = more recently used (index blocks_lru)
    CREATE TABLE stats (name TEXT PRIMARY KEY, value INTEGER NOT NULL)
        -- one row each: lookups (sequences looked up), hits (lookups with >= 1 cached
        -- block), hit_blocks, miss_blocks (full blocks looked up but not cached),
        -- inserted (blocks newly inserted), evictions (blocks evicted), clock (the
        -- logical clock's last value; not a counter)

Warm-up (Triton's ``model_warmup``; every example model's ``config.pbtxt`` declares one sample,
``orchid-warmup``): Triton runs the sample once on each instance while it loads the model,
before the model (and, with strict readiness, the server) reports ready. The sample carries an
input the model does not declare, ``ORCHID_WARMUP`` (``WARMUP_INPUT``): Triton passes it on to
the model as a control input, and refuses it from any client (a request with an input the
config does not declare is invalid), so the emulator knows a warm-up request for sure. Why: an
instance's first execution is slow in Triton's Python backend, ~20-25 ms more than later ones
whatever the time factor (measured on Triton 2.51: outside the model's own ``execute``, which
takes ~1 ms; the stub's first request round trip), and a server restarted under traffic would
otherwise give its first requests to cold instances. A warm-up request is answered at once
(one token: the same path of inputs read, a response built and sent back) without the emulated
device time and without touching what the emulator counts or shares: execution counts of
``fail_execute`` and ``invalid_output_after``, devices and their log, the prefix cache. Triton's
own statistics do count it (one execution and one inference per instance at load).

Cancellation: decode runs in steps; between steps the emulator checks
`request.is_cancelled()` and stops decoding a cancelled request, which frees
the instance early exactly as a real server frees a slot.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
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
# The control input of the models' warm-up sample (``model_warmup`` in config.pbtxt): see
# "Warm-up" in the module docstring.
WARMUP_INPUT = "ORCHID_WARMUP"


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


def is_warmup(request: object) -> bool:
    """A request of Triton's ``model_warmup`` sample: it carries ``WARMUP_INPUT``, which no
    client can send (see "Warm-up" in the module docstring)."""
    return pb_utils.get_input_tensor_by_name(request, WARMUP_INPUT) is not None


def warmup_response(request: object) -> object:
    """A warm-up request's answer: one token per row of its ``INPUT_IDS``, no device time."""
    ids = pb_utils.get_input_tensor_by_name(request, "INPUT_IDS").as_numpy()
    out = output_tokens(ids, 1)
    tokens = np.tile(out, (ids.shape[0], 1)) if ids.ndim == 2 else out
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT_IDS", tokens)])


def request_parameters(request: object) -> dict:
    raw = request.parameters()  # type: ignore[attr-defined]
    return json.loads(raw) if raw else {}


def requested_output_tokens(request: object, default: int) -> int:
    value = request_parameters(request).get("max_output_tokens", default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"parameter max_output_tokens must be a positive integer, got {value!r}")
    return value


def time_factor() -> float:
    raw = os.environ.get("ORCHID_TIME_FACTOR", "1.0")
    factor = float(raw)
    if factor < 0:
        raise ValueError(f"ORCHID_TIME_FACTOR must be >= 0, got {raw!r}")
    return factor


class PlacementError(Exception):
    """An execution cannot hold devices: one it must hold is lost, or no unit is left."""


_DEVICE_LIST = re.compile(r"\s*\d+\s*(,\s*\d+\s*)*", re.ASCII)


class SharedDevices:
    """Lock files standing for a fleet of devices that several models' instances share
    (``ORCHID_DEVICE_DIR``; see the module docstring): one execution holds a unit of
    ``tensor_parallel`` of them, all at once."""

    def __init__(
        self,
        directory: str,
        devices: int,
        instance_name: str,
        *,
        tensor_parallel: int = 1,
        model: str = "",
        log_path: str = "",
    ) -> None:
        if devices < 1:
            raise ValueError(f"ORCHID_DEVICES must be >= 1, got {devices}")
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.count = devices
        self.tp = tensor_parallel
        self.model = model
        self.log_path = log_path
        match = re.search(r"(\d+)$", instance_name)
        self.own = (int(match.group(1)) if match else 0) % devices
        paths = [os.path.join(directory, f"device-{d}.lock") for d in range(devices)]
        self.fds = [os.open(path, os.O_RDWR | os.O_CREAT) for path in paths]

    @classmethod
    def from_env(
        cls, instance_name: str, *, tensor_parallel: int = 1, model: str = ""
    ) -> SharedDevices | None:
        directory = os.environ.get("ORCHID_DEVICE_DIR")
        if not directory:
            return None
        return cls(
            directory,
            int(os.environ.get("ORCHID_DEVICES", "4")),
            instance_name,
            tensor_parallel=tensor_parallel,
            model=model,
            log_path=os.environ.get("ORCHID_DEVICE_LOG", ""),
        )

    def named_unit(self, raw: object) -> tuple[int, ...] | None:
        """The devices a request's ``devices`` parameter names (None: it names none).
        Raises ValueError, with the message its error response carries, when they are bad."""
        if raw is None:
            return None
        if isinstance(raw, int) and not isinstance(raw, bool):
            raw = str(raw)
        if not isinstance(raw, str) or not _DEVICE_LIST.fullmatch(raw):
            raise ValueError(
                f'parameter devices must be device indices separated by commas, like "2,3"; got {raw!r}'
            )
        unit = [int(part) for part in raw.split(",")]
        for d in unit:
            if d >= self.count:
                raise ValueError(
                    f"parameter devices names device {d}, outside the {self.count} emulated devices "
                    f"0..{self.count - 1} (ORCHID_DEVICES); got {raw!r}"
                )
        if len(set(unit)) != len(unit):
            twice = next(d for d in unit if unit.count(d) > 1)
            raise ValueError(f"parameter devices names device {twice} more than once; got {raw!r}")
        if len(unit) != self.tp:
            raise ValueError(
                f"parameter devices names {len(unit)} device(s) ({raw!r}) but {self.model or 'this model'} "
                f"is tensor-parallel of degree {self.tp}: its unit is {self.tp} device(s)"
            )
        return tuple(sorted(unit))

    def lost(self) -> set[int]:
        """The devices marked lost now (``device-<d>.lost``)."""
        return {
            d for d in range(self.count) if os.path.exists(os.path.join(self.directory, f"device-{d}.lost"))
        }

    def _lost_error(self, lost: set[int], unit: tuple[int, ...]) -> PlacementError:
        d = min(lost & set(unit))
        return PlacementError(
            f"CUDA error: device {d} is lost (device-{d}.lost in ORCHID_DEVICE_DIR; the execution on "
            f"devices {','.join(map(str, unit))} did not start)"
        )

    def _take(self, unit: tuple[int, ...]) -> bool:
        """All of ``unit``'s locks, or none: never one held while another is busy."""
        taken: list[int] = []
        for d in unit:
            try:
                fcntl.flock(self.fds[d], fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                for t in taken:
                    fcntl.flock(self.fds[t], fcntl.LOCK_UN)
                return False
            taken.append(d)
        return True

    def _release(self, unit: tuple[int, ...]) -> None:
        for d in unit:
            fcntl.flock(self.fds[d], fcntl.LOCK_UN)

    def _busy(self, d: int) -> bool:
        """Is device d held by someone now? (A momentary probe of its lock.)"""
        if self._take((d,)):
            self._release((d,))
            return False
        return True

    def _try_choose(self, lost: set[int]) -> tuple[int, ...] | None:
        """A free unit of the model's own choosing (no ``devices`` named), or None."""
        if self.tp > 1:
            units = [tuple(range(k * self.tp, (k + 1) * self.tp)) for k in range(self.count // self.tp)]
            for unit in units:
                if not lost & set(unit) and self._take(unit):
                    return unit
            return None
        order = [self.own] + [d for d in range(self.count) if d != self.own]
        loose: list[int] = []  # free-looking devices whose partner is free too: taken last
        for d in order:
            if d in lost:
                continue
            partner = d ^ 1
            if partner < self.count and partner not in lost and not self._busy(partner):
                loose.append(d)
                continue
            if self._take((d,)):
                return (d,)
        for d in loose:
            if self._take((d,)):
                return (d,)
        return None

    def _acquire(self, named: tuple[int, ...] | None) -> tuple[int, ...]:
        while True:  # every candidate busy: poll until one frees (or a device is lost)
            lost = self.lost()
            if named is not None:
                if lost & set(named):
                    raise self._lost_error(lost, named)
                if self._take(named):
                    return named
            else:
                usable = [d for d in range(self.count) if d not in lost]
                if self.tp > 1:
                    units = [range(k * self.tp, (k + 1) * self.tp) for k in range(self.count // self.tp)]
                    usable = [d for unit in units if not lost & set(unit) for d in unit]
                if not usable:
                    raise PlacementError(
                        f"CUDA error: no unit of {self.tp} device(s) without a lost device among the "
                        f"{self.count} emulated devices (lost: {sorted(lost) or 'none'}; ORCHID_DEVICES)"
                    )
                held = self._try_choose(lost)
                if held is not None:
                    return held
            time.sleep(_DEVICE_POLL_S)

    @contextmanager
    def hold(self, named: tuple[int, ...] | None = None, requests: int = 1) -> Iterator[tuple[int, ...]]:
        """Hold ``named`` (or a unit of this model's choosing) for the block; raises
        PlacementError, holding nothing, where that cannot be. Logs the execution after it."""
        unit = self._acquire(named)
        start = time.time()
        try:
            yield unit
        finally:
            end = time.time()
            self._release(unit)
            self._log(unit, start, end, requests)

    def _log(self, unit: tuple[int, ...], start: float, end: float, requests: int) -> None:
        if not self.log_path:
            return
        line = json.dumps(
            {"model": self.model, "devices": list(unit), "start": start, "end": end, "requests": requests}
        )
        fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())  # one write per line: processes do not interleave
        finally:
            os.close(fd)


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


PREFIX_STATS = ("lookups", "hits", "hit_blocks", "miss_blocks", "inserted", "evictions", "clock")
_PREFIX_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS blocks (key BLOB PRIMARY KEY, last_used INTEGER NOT NULL)",
    "CREATE INDEX IF NOT EXISTS blocks_lru ON blocks (last_used)",
    "CREATE TABLE IF NOT EXISTS stats (name TEXT PRIMARY KEY, value INTEGER NOT NULL)",
)


def prefix_scope(request: object) -> str:
    """The request's ``prefix_scope`` parameter ("" when absent); ValueError when not a string."""
    scope = request_parameters(request).get("prefix_scope", "")
    if not isinstance(scope, str):
        raise ValueError(f"parameter prefix_scope must be a string, got {scope!r}")
    return scope


def block_keys(scope: str, tokens: np.ndarray, block_tokens: int) -> list[bytes]:
    """The chained keys of a sequence's full blocks (see "Prefix cache" in the module docstring)."""
    tokens = np.asarray(tokens).reshape(-1)
    keys: list[bytes] = []
    previous = scope.encode("utf-8") + b"\x00"
    for b in range(len(tokens) // block_tokens):
        block = tokens[b * block_tokens : (b + 1) * block_tokens].astype("<i4").tobytes()
        previous = hashlib.sha256(previous + block).digest()[:16]
        keys.append(previous)
    return keys


class PrefixCache:
    """A model's prefix cache (see "Prefix cache" in the module docstring): SQLite in
    ``ORCHID_PREFIX_CACHE_DIR`` shared by the model's instances, else in memory per instance."""

    KEYS = ("prefix_block_tokens", "prefix_cache_blocks")

    def __init__(self, model: str, block_tokens: int, capacity: int, directory: str = "") -> None:
        self.block_tokens = block_tokens
        self.capacity = capacity
        if directory:
            os.makedirs(directory, exist_ok=True)
            self.path = os.path.join(directory, f"{model}.prefix.sqlite")
        else:
            self.path = ":memory:"
        # Autocommit mode: transactions are the explicit BEGIN IMMEDIATE ... COMMIT below.
        self.db = sqlite3.connect(self.path, timeout=60.0, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA busy_timeout = 60000")
        if directory:
            self._wal()
        with self._transaction():
            for statement in _PREFIX_SCHEMA:
                self.db.execute(statement)
            self.db.executemany(
                "INSERT OR IGNORE INTO stats (name, value) VALUES (?, 0)", [(n,) for n in PREFIX_STATS]
            )

    def _wal(self) -> None:
        """Put the shared file in WAL mode. The instances open it at the same moment when a
        server starts, and SQLite answers a journal-mode change that meets another connection's
        lock with "database is locked" at once, without its busy handler: so retry (once one
        instance has set it, the mode is the file's and the others see "wal")."""
        deadline = time.monotonic() + 60.0
        while True:
            try:
                mode = self.db.execute("PRAGMA journal_mode = WAL").fetchone()
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
                continue
            if mode is not None and str(mode[0]).lower() == "wal":
                return
            if time.monotonic() > deadline:
                raise sqlite3.OperationalError(f"could not put {self.path} in WAL mode (mode {mode!r})")
            time.sleep(0.01)

    @classmethod
    def from_model_config(cls, config: dict, model: str) -> PrefixCache | None:
        params = config.get("parameters", {})
        present = [key for key in cls.KEYS if key in params]
        if not present:
            return None
        if len(present) != len(cls.KEYS):
            missing = next(key for key in cls.KEYS if key not in params)
            raise pb_utils.TritonModelException(
                f"model config parameter {missing!r} is required with {present[0]!r} (prefix cache)"
            )
        values: list[int] = []
        for key in cls.KEYS:
            raw = str(params[key].get("string_value", "")).strip()
            if not raw.isdigit() or int(raw) < 1:
                raise pb_utils.TritonModelException(
                    f"model config parameter {key!r} must be an integer >= 1, got {raw!r}"
                )
            values.append(int(raw))
        return cls(model, values[0], values[1], os.environ.get("ORCHID_PREFIX_CACHE_DIR", ""))

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def lookup(self, scope: str, tokens: np.ndarray) -> int:
        """Look a sequence up, then insert/touch all of its full blocks (evicting the least
        recently used beyond capacity): its cached tokens (capped at ``len(tokens) - 1``)."""
        keys = block_keys(scope, tokens, self.block_tokens)
        n = int(np.asarray(tokens).size)
        db = self.db
        with self._transaction():
            cached = 0
            for key in keys:
                if db.execute("SELECT 1 FROM blocks WHERE key = ?", (key,)).fetchone() is None:
                    break
                cached += 1
            clock = int(db.execute("SELECT value FROM stats WHERE name = 'clock'").fetchone()[0])
            # One tick per lookup; within it the deeper blocks are older (evicted first).
            tick = clock + len(keys)
            existing = {
                row[0]
                for key in keys
                for row in db.execute("SELECT key FROM blocks WHERE key = ?", (key,)).fetchall()
            }
            db.executemany(
                "INSERT INTO blocks (key, last_used) VALUES (?, ?) "
                "ON CONFLICT (key) DO UPDATE SET last_used = excluded.last_used",
                [(key, tick - depth) for depth, key in enumerate(keys)],
            )
            inserted = len(set(keys) - existing)
            evicted = 0
            if inserted:
                over = int(db.execute("SELECT COUNT(*) FROM blocks").fetchone()[0]) - self.capacity
                if over > 0:
                    evicted = db.execute(
                        "DELETE FROM blocks WHERE key IN "
                        "(SELECT key FROM blocks ORDER BY last_used ASC LIMIT ?)",
                        (over,),
                    ).rowcount
            counts = {
                "lookups": 1,
                "hits": 1 if cached else 0,
                "hit_blocks": cached,
                "miss_blocks": len(keys) - cached,
                "inserted": inserted,
                "evictions": evicted,
            }
            db.executemany(
                "UPDATE stats SET value = value + ? WHERE name = ?", [(v, k) for k, v in counts.items()]
            )
            db.execute("UPDATE stats SET value = ? WHERE name = 'clock'", (tick,))
        return max(0, min(cached * self.block_tokens, n - 1))


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
        raw_tp = param("tensor_parallel", "1")
        if not raw_tp.isdigit() or int(raw_tp) < 1:
            raise pb_utils.TritonModelException(
                f"model config parameter tensor_parallel must be >= 1, got {raw_tp!r}"
            )
        self.tensor_parallel = int(raw_tp)
        self.devices = SharedDevices.from_env(
            str(args.get("model_instance_name", "")),
            tensor_parallel=self.tensor_parallel,
            model=str(config.get("name", args.get("model_name", ""))),
        )
        self.prefix = PrefixCache.from_model_config(
            config, str(config.get("name", args.get("model_name", "")))
        )

    def _placement(self, requests: list) -> tuple[list[int], dict[int, str], tuple[int, ...] | None]:
        """Shared devices: the indices of the requests that may run, the errors of those whose
        ``devices`` parameter is bad, and the union of the devices the others name (None: none
        named, the execution chooses its unit)."""
        assert self.devices is not None
        ok: list[int] = []
        errors: dict[int, str] = {}
        named: set[int] = set()
        for i, request in enumerate(requests):
            try:
                unit = self.devices.named_unit(request_parameters(request).get("devices"))
            except ValueError as exc:
                errors[i] = str(exc)
                continue
            ok.append(i)
            named.update(unit or ())
        return ok, errors, tuple(sorted(named)) if named else None


class BatchEmulator(_Emulator):
    """Non-decoupled model: one response per request, batch held for its cost."""

    def execute(self, requests: list) -> list:
        if requests and all(is_warmup(r) for r in requests):  # Triton's model_warmup, at load
            return [warmup_response(r) for r in requests]
        if self.devices is None:
            return self._execute(requests)
        responses: list = [None] * len(requests)
        ok, errors, named = self._placement(requests)
        for i, message in errors.items():
            responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(message))
        if ok:
            batch = [requests[i] for i in ok]
            try:
                with self.devices.hold(named, len(batch)):
                    answers = self._execute(batch)
            except PlacementError as exc:  # raised before anything was held
                pb_utils.Logger.log_error(str(exc))
                answers = [pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))) for _ in batch]
            for i, answer in zip(ok, answers, strict=True):
                responses[i] = answer
        return responses

    def _execute(self, requests: list) -> list:
        p = self.profile
        work = []
        responses: list = [None] * len(requests)
        seen: dict[int, np.ndarray] = {}  # request index -> the FEATURES it carried
        scopes: dict[int, str] = {}  # request index -> its prefix_scope (prefix-cache models)
        for i, request in enumerate(requests):
            try:
                ids = pb_utils.get_input_tensor_by_name(request, "INPUT_IDS").as_numpy()
                n_out = requested_output_tokens(request, p.default_max_output_tokens)
            except ValueError as exc:
                responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc)))
                continue
            if self.prefix is not None:
                try:
                    scopes[i] = prefix_scope(request)
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
            cached: dict[int, list[int]] = {}  # request index -> each row's cached tokens (prefix cache)
            if self.prefix is None:
                prefill_ms = p.fixed_ms + p.prefill_ms_per_token * len(work) * longest_in
            else:
                uncached = 0
                for i, _, ids, _ in work:
                    rows = ids if ids.ndim == 2 else ids.reshape(1, -1)
                    hits = [self.prefix.lookup(scopes[i], row) for row in rows]
                    cached[i] = hits
                    uncached = max([uncached, *(ids.shape[-1] - hit for hit in hits)])
                prefill_ms = p.fixed_ms + p.prefill_ms_per_token * len(work) * uncached
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
                if i in cached:  # a prefix-cache model: each row's cached tokens
                    counts = np.array(cached[i], dtype=np.int32)
                    shape = (ids.shape[0], 1) if ids.ndim == 2 else (1,)
                    tensors.append(pb_utils.Tensor("PREFIX_CACHED_TOKENS", counts.reshape(shape)))
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

    def initialize(self, args: dict) -> None:
        super().initialize(args)
        if self.prefix is not None:
            raise pb_utils.TritonModelException(
                "model config parameters 'prefix_block_tokens' and 'prefix_cache_blocks' (a prefix "
                "cache) are supported by non-decoupled models only"
            )

    def execute(self, requests: list) -> None:
        if requests and all(is_warmup(r) for r in requests):  # Triton's model_warmup, at load
            for request in requests:
                request.get_response_sender().send(
                    warmup_response(request), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
                )
            return None
        if self.devices is None:
            self._execute(requests)
            return None
        ok, errors, named = self._placement(requests)
        for i, message in errors.items():
            self._fail(requests[i], message)
        if ok:
            batch = [requests[i] for i in ok]
            try:
                with self.devices.hold(named, len(batch)):
                    self._execute(batch)
            except PlacementError as exc:  # raised before anything was held
                pb_utils.Logger.log_error(str(exc))
                for request in batch:
                    self._fail(request, str(exc))
        return None

    @staticmethod
    def _fail(request: object, message: str) -> None:
        request.get_response_sender().send(  # type: ignore[attr-defined]
            pb_utils.InferenceResponse(error=pb_utils.TritonError(message)),
            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
        )

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
