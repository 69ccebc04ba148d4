"""Prefix affinity: where a prompt's cached prefix is, what a hit saves, and the scope it may
never cross.

This module owns the pure parts of tenant-scoped prefix-aware routing (issue 32):

* **Scope** (``scope_for``): the key a backend's prefix cache keeps a request's blocks under.
  It always holds the tenant, the privacy cell and the model version, so two tenants sending
  the same prompt never share an entry (no cross-tenant timing oracle), a dedicated tenant's
  entries are its own, and a new version starts cold. The gateway sends it to the backend as
  the gateway-owned request parameter ``prefix_scope`` (a caller's is removed).
* **Blocks** (``block_keys``): the prompt cut into full blocks of the backend's declared
  ``block_tokens``; block *i*'s key chains the scope and every block before it (as the
  capacity emulator and ``MemoryBackend`` key their caches), so a block matches only when
  the whole prefix before it matches, in the same scope.
* **The index** (``PrefixIndex``): per pool, an approximate LRU of the block keys recently
  sent there, bounded like the backend's own cache. It is the gateway's belief, not the
  backend's truth: ``HitRate`` learns per (route, tenant) how much of the expected hit the
  backend reported, so the price a hit lowers stays honest.
* **The choice** (``choose``): the candidate with the best expected saving, as long as its
  predicted wait is within ``max_extra_wait_ms`` of the least-loaded candidate's (bounded
  load); otherwise the best saving inside the bound, or the least-loaded pool (a spill).

No I/O and no clock.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# The request parameter that carries the scope to the backend (gateway-owned).
SCOPE_PARAMETER = "prefix_scope"
# How a backend reports the prompt tokens its cache served: the response parameter (where the
# server can set response parameters), or an INT32 output of that name, one value per row
# (Triton 2.51's Python backend cannot set response parameters: the capacity emulator's way).
CACHED_TOKENS_PARAMETER = "prefix_cached_tokens"
CACHED_TOKENS_OUTPUT = "PREFIX_CACHED_TOKENS"
# Bytes of one INT32 token, as the tokens input carries it (little-endian raw contents).
TOKEN_BYTES = 4


@dataclass(frozen=True, slots=True)
class PrefixCacheSpec:
    """A backend model's prefix cache, as its model config declares it."""

    block_tokens: int
    capacity_blocks: int

    def __post_init__(self) -> None:
        if self.block_tokens < 1 or self.capacity_blocks < 1:
            raise ValueError(
                f"a prefix cache needs block_tokens >= 1 and capacity_blocks >= 1, got "
                f"{self.block_tokens} and {self.capacity_blocks}"
            )


def declared_cache(parameters: Mapping[str, str]) -> PrefixCacheSpec | None:
    """The prefix cache a model's config parameters declare (``prefix_block_tokens`` and
    ``prefix_cache_blocks``, as the capacity emulator reads them), or None. One half alone, or
    a value that is not a positive integer, declares none (the emulator refuses to load such
    a config, so Triton never serves it). The gateway reads Triton's model config with it; the
    capacity worksheet reads the repository's ``config.pbtxt``."""
    if "prefix_block_tokens" not in parameters or "prefix_cache_blocks" not in parameters:
        return None
    try:
        return PrefixCacheSpec(int(parameters["prefix_block_tokens"]), int(parameters["prefix_cache_blocks"]))
    except ValueError:
        return None


def scope_for(tenant: str, cell: str, model: str, version: str) -> str:
    """The cache scope of a tenant's requests to one model version in one privacy cell."""
    return f"{tenant}|{cell}|{model}@{version or 'latest'}"


def block_keys(scope: str, tokens: bytes, block_tokens: int) -> tuple[bytes, ...]:
    """The chained keys of ``tokens``' full blocks (``tokens``: little-endian INT32 bytes of one
    sequence). A partial tail block has no key: it is never cached."""
    size = block_tokens * TOKEN_BYTES
    blocks = len(tokens) // size
    keys: list[bytes] = []
    previous = scope.encode() + b"\x00"
    for i in range(blocks):
        key = hashlib.sha256(previous + tokens[i * size : (i + 1) * size]).digest()[:16]
        keys.append(key)
        previous = key
    return tuple(keys)


def cached_tokens(matched_blocks: int, block_tokens: int, input_tokens: int) -> int:
    """Prompt tokens a hit of ``matched_blocks`` leading blocks serves: at least one token is
    always computed (the backend needs the last position's state)."""
    return max(0, min(matched_blocks * block_tokens, input_tokens - 1))


@dataclass(frozen=True, slots=True)
class PrefixQuery:
    """A request's prompt as affinity sees it: its blocks' keys (chained from its scope)."""

    keys: tuple[bytes, ...]
    input_tokens: int
    block_tokens: int

    def tokens(self, matched_blocks: int) -> int:
        return cached_tokens(matched_blocks, self.block_tokens, self.input_tokens)


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Where a request was placed, as its prefix cache sees it. Only the request's primary
    placement carries one (a rollout's candidate or a fallback pool is a placement of its own,
    without it), so a placement's match is always of its own pool."""

    query: PrefixQuery
    pool: str  # the chosen pool (its queue's name)
    index_tokens: int  # the cached tokens the pool's index expected
    priced_tokens: int  # index_tokens x the learned rate: what pricing took off its prefill
    prefill_ms_per_token: float = 0.0  # what one cached token saves there (the profile's price)
    spilled: bool = False
    extra_wait_ms: float = 0.0


class PrefixIndex:
    """The block keys recently sent to one pool, least recently used first (bounded)."""

    __slots__ = ("_keys", "capacity", "evictions")

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self.evictions = 0
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def match(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``' leading blocks the index holds."""
        held = self._keys
        n = 0
        for key in keys:
            if key not in held:
                break
            n += 1
        return n

    def record(self, keys: Sequence[bytes]) -> None:
        """``keys`` were sent to the pool: its cache now holds them, most recently used, the
        first block the most recent of all (a deeper block is useless without the ones before
        it, so it is evicted first, as the backends' caches do)."""
        held = self._keys
        for key in reversed(keys):
            if key in held:
                held.move_to_end(key)
            else:
                held[key] = None
        while len(held) > self.capacity:
            held.popitem(last=False)
            self.evictions += 1


@dataclass(slots=True)
class _Rate:
    expected: float = 0.0
    observed: float = 0.0


class HitRate:
    """Per (route, tenant): the share of the index's expected cached tokens the backend
    reported serving, decayed per observation (``alpha``). A key never observed is believed
    at ``prior``; the belief moves toward what is observed, so an index that over-promises
    (another gateway replica's traffic evicted the blocks, the backend's cache is smaller)
    stops lowering prices by hits that do not happen."""

    def __init__(self, *, alpha: float = 0.1, prior: float = 1.0) -> None:
        self.alpha = alpha
        self.prior = prior
        self._rates: dict[tuple[str, str], _Rate] = {}

    def rate(self, route: str, tenant: str) -> float:
        entry = self._rates.get((route, tenant))
        if entry is None or entry.expected <= 0.0:
            return self.prior
        return max(0.0, min(1.0, entry.observed / entry.expected))

    def expected_tokens(self, route: str, tenant: str, index_tokens: int) -> int:
        """The cached tokens to price: the index's expectation times the learned rate."""
        if index_tokens <= 0:
            return 0
        return int(index_tokens * self.rate(route, tenant))

    def observe(self, route: str, tenant: str, index_tokens: int, reported_tokens: int) -> None:
        """One answer: the index expected ``index_tokens`` cached, the backend reported
        ``reported_tokens``. Only answers with an expectation teach the rate."""
        if index_tokens <= 0:
            return
        seen = min(reported_tokens, index_tokens)
        entry = self._rates.get((route, tenant))
        if entry is None:
            self._rates[(route, tenant)] = _Rate(float(index_tokens), float(seen))
            return
        keep = 1.0 - self.alpha
        entry.expected = keep * entry.expected + self.alpha * index_tokens
        entry.observed = keep * entry.observed + self.alpha * seen


@dataclass(frozen=True, slots=True)
class Option:
    """One candidate pool as affinity sees it."""

    wait_ms: float  # its predicted wait for a device
    saving_ms: float  # accelerator-ms the expected hit saves there


@dataclass(frozen=True, slots=True)
class Choice:
    """Affinity's pick among the candidates (indices into them)."""

    index: int
    spilled: bool  # a better saving was outside the load bound
    extra_wait_ms: float  # the pick's predicted wait above the least-loaded candidate's


def choose(options: Sequence[Option], least: int, max_extra_wait_ms: float) -> Choice:
    """The candidate with the best expected saving whose predicted wait is within
    ``max_extra_wait_ms`` of the least-loaded one's (``least``: the index the load ranking
    picked); ties go to the least-loaded pick, then to the earlier candidate. With no saving
    anywhere, the least-loaded pick."""
    if not options:
        raise ValueError("choose needs at least one option")
    floor = options[least].wait_ms
    bound = floor + max_extra_wait_ms
    inside = [i for i in range(len(options)) if options[i].wait_ms <= bound]
    pick = max(inside, key=lambda i: (options[i].saving_ms, i == least, -i))
    if options[pick].saving_ms <= 0.0:
        pick = least
    best = max(option.saving_ms for option in options)
    return Choice(pick, best > options[pick].saving_ms, options[pick].wait_ms - floor)
