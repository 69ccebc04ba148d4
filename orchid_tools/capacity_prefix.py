"""The worksheet's "Prefix cache" section (``orchid-gateway capacity FILE --gateway CONFIG``).

The seed's "record memory by lifetime", for the prefix caches a model server keeps (issue 32):
for every route whose backend model declares one (its Triton config's parameters
``prefix_block_tokens`` and ``prefix_cache_blocks``, as the gateway reads them at run time in
``gateway.core.prefix.declared_cache``), per backend serving it:

* the memory the cache holds when full: ``capacity_blocks x block_tokens x
  live_cache_bytes_per_token`` (the route profile's bytes of sequence state per token), and what
  it leaves of a device's live room (the same device memory as live sequence state; the
  gateway's live-memory bound does not subtract it);
* its lifetime: how long a block stays cached before LRU eviction at the route's offered rate,
  ``capacity_blocks x block_tokens / unique prompt tokens per second`` reaching that backend
  (at the workload's rate for classes calling the route; else per 1,000, 10,000 and 100,000
  unique prompt tokens/s);
* the reuse condition: a conversation's next turn hits only if it arrives within the lifetime
  (against the class's ``think_time_s`` where declared).

The worksheet reads configuration, not Triton: a ``local_triton``'s model repository holds the
model configs (``model_parameters``); remote ``backends`` are named as unseen and skipped.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.core.memory import DeviceMemory, live_tokens, resident_bytes
from gateway.core.prefix import declared_cache
from gateway.core.profile import GIB
from orchid_tools.capacity import Figure, Section, backend_topologies

if TYPE_CHECKING:
    from gateway.config import GatewayConfig, LocalTritonConfig, RouteTable
    from orchid_tools.capacity import Workload

TITLE = "Prefix cache"
# Unique prompt tokens per second the lifetime is tabled at when no workload class calls a route.
TABLE_RATES = (1_000.0, 10_000.0, 100_000.0)

_PARAMETER = re.compile(r'key:\s*"([^"]+)"\s*,\s*value:\s*\{\s*string_value:\s*"([^"]*)"\s*\}')


def model_parameters(repository: Path, model: str) -> dict[str, str]:
    """A model's ``config.pbtxt`` ``parameters`` string values (key -> value) in a Triton model
    repository: a small regex reader of the form the example configs use
    (``{ key: "k", value: { string_value: "v" } }``); {} when the model has no config."""
    path = repository / model / "config.pbtxt"
    if not path.is_file():
        return {}
    return dict(_PARAMETER.findall(path.read_text()))


def _n(value: float, decimals: int = 3) -> str:
    text = f"{value:,.{decimals}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text or "0"


def _gib(value: float) -> str:
    return _n(value / GIB, 2)


def _local_room(
    local: LocalTritonConfig, config: GatewayConfig, routes: RouteTable, model: str
) -> tuple[int, str]:
    """The live room per device of ``model``'s devices on the local Triton, as its pool places
    it (``PoolRegistry.queue_for``), and how it was computed."""
    from gateway.server import LOCAL_BACKEND

    memory = DeviceMemory.from_gib(local.device_memory_gib, local.runtime_reserve_gib)
    head = f"{_n(local.device_memory_gib, 2)} device - {_n(local.runtime_reserve_gib, 2)} reserve"
    if local.topology is not None:
        for b in backend_topologies(config, routes):
            if b.backend == LOCAL_BACKEND:
                room = b.live_room_per_device
                return room, (
                    f"{head} - {_gib(b.resident_per_device)} resident GiB (every model's share: the "
                    "topology's devices are shared; as Parallel topology prints it)"
                )
    repository = local.model_repository
    if local.shared_devices:
        profiles: dict[str, str] = {}
        for route in routes.models.values():
            if (repository / route.backend_model).is_dir():
                profiles.setdefault(route.backend_model, route.profile)
        resident = sum(resident_bytes(routes.profiles[p]) for p in profiles.values())
        how = f"every model's weights and workspace ({len(profiles)} models on shared devices)"
    else:
        profile = next(r.profile for r in routes.models.values() if r.backend_model == model)
        resident = resident_bytes(routes.profiles[profile])
        how = f"{model}'s weights and workspace ({profile}; its own devices)"
    room = memory.live_room_bytes(resident)
    return room, f"{head} - {_gib(resident)} resident GiB: {how}"


def _class_rates(workload: Workload | None, route: str) -> list[tuple[str, float, int, bool, float | None]]:
    """The workload's classes calling ``route``: (name, req/s, unique prompt tokens per request,
    whether those were declared, think time s)."""
    if workload is None:
        return []
    out = []
    for name, cls in workload.classes.items():
        if cls.model != route:
            continue
        declared = cls.unique_input_tokens is not None
        unique = cls.unique_input_tokens if cls.unique_input_tokens is not None else cls.input_tokens
        out.append((name, cls.rate_per_s, unique, declared, cls.think_time_s))
    return out


def prefix_section(
    config: GatewayConfig, routes: RouteTable, workload: Workload | None = None
) -> Section | None:
    """The section; None when no local route's model declares a prefix cache and no remote
    backend is configured (whose model configs the worksheet cannot see)."""
    from gateway.server import LOCAL_BACKEND

    figures: list[Figure] = []
    local = config.local_triton
    remote = [b.name for b in config.backends if local is None or b.name != LOCAL_BACKEND]
    all_backends = [*remote, *([LOCAL_BACKEND] if local is not None else [])]
    if remote:
        figures.append(
            Figure(
                "prefix.remote",
                "remote backends: prefix caches",
                None,
                "",
                f"n/a: backends {', '.join(remote)} are remote Tritons: the worksheet reads model "
                "configs from a local_triton's model repository and cannot see theirs; skipped",
            )
        )
    if local is None:
        return Section(TITLE, tuple(figures)) if figures else None
    repository = local.model_repository
    for name, route in sorted(routes.models.items()):
        if route.backends and LOCAL_BACKEND not in route.backends:
            continue
        spec = declared_cache(model_parameters(repository, route.backend_model))
        if spec is None:
            continue
        serving = [b for b in all_backends if not route.backends or b in route.backends]
        profile = routes.profiles[route.profile]
        per_token = profile.live_cache_bytes_per_token
        tokens = spec.capacity_blocks * spec.block_tokens
        key = f"prefix.{name}"
        lk = f"{key}.{LOCAL_BACKEND}"
        figures.append(
            Figure(
                f"{key}.tokens",
                f"{name}: prefix cache, tokens",
                tokens,
                "tokens",
                f"{route.backend_model}'s config.pbtxt: {spec.capacity_blocks:,} blocks "
                f"(prefix_cache_blocks) x {spec.block_tokens} tokens (prefix_block_tokens), per server; "
                "full blocks only",
            )
        )
        if route.prefix_affinity is not None:
            bound = route.prefix_affinity.max_extra_wait_ms
            figures.append(
                Figure(
                    f"{key}.affinity_bound_ms",
                    f"{name}: affinity bound",
                    bound,
                    "ms",
                    f"prefix_affinity.max_extra_wait_ms: a prompt goes to the backend expected to hold its "
                    f"prefix unless its predicted wait is over {_n(bound)} ms above the least-loaded "
                    "one's; then it spills and is prefilled there",
                    decimals=1,
                )
            )
        cache_bytes = tokens * per_token
        figures.append(
            Figure(
                f"{lk}.cache_bytes",
                f"{name} @ {LOCAL_BACKEND}: cache held when full",
                cache_bytes,
                "B",
                f"{_gib(cache_bytes)} GiB = {spec.capacity_blocks:,} blocks x {spec.block_tokens} tokens x "
                f"{per_token:,} B per token ({route.profile}'s live_cache_bytes_per_token)",
            )
        )
        room, how = _local_room(local, config, routes, route.backend_model)
        figures.append(
            Figure(
                f"{lk}.live_room",
                f"{name} @ {LOCAL_BACKEND}: live room per device",
                room,
                "B",
                f"{_gib(room)} GiB = {how}",
            )
        )
        left = room - cache_bytes
        left_tokens = live_tokens(max(left, 0), per_token)
        if left >= 0:
            verdict = f"fits; {left_tokens:,} live tokens left there" if left_tokens is not None else "fits"
        else:
            verdict = "DOES NOT FIT: a full cache leaves no room for live sequence state on that device"
        figures.append(
            Figure(
                f"{lk}.live_room_left",
                f"{name} @ {LOCAL_BACKEND}: live room left",
                left,
                "B",
                f"{_gib(left)} GiB = {_gib(room)} - {_gib(cache_bytes)} GiB: the cache lives in the same "
                f"device memory as live sequence state (if one device holds it all): {verdict}; the "
                "gateway's live-memory bound does not subtract it",
            )
        )
        classes = _class_rates(workload, name)
        share = len(serving)
        split = f" / {share} backends serving it (affinity keeps a conversation on one)" if share > 1 else ""
        if classes:
            unique_per_s = sum(rate * unique for _, rate, unique, _, _ in classes) / share
            parts = " + ".join(
                f"{c} {_n(rate)} req/s x {unique:,} "
                + ("unique" if declared else "input (all counted new)")
                + " tokens"
                for c, rate, unique, declared, _ in classes
            )
            figures.append(
                Figure(
                    f"{lk}.unique_tokens_per_s",
                    f"{name} @ {LOCAL_BACKEND}: unique prompt tokens",
                    unique_per_s,
                    "tokens/s",
                    f"{parts}{split}: the tokens that insert new blocks",
                    decimals=1,
                )
            )
            lifetime = tokens / unique_per_s if unique_per_s > 0 else None
            figures.append(
                Figure(
                    f"{lk}.lifetime_s",
                    f"{name} @ {LOCAL_BACKEND}: cache lifetime",
                    lifetime,
                    "s",
                    f"{tokens:,} cached tokens / {_n(unique_per_s, 1)} unique prompt tokens/s: how long a "
                    "block stays before LRU eviction (a hit refreshes it)"
                    if lifetime is not None
                    else "n/a: no unique prompt tokens reach it (rate 0): blocks are never evicted",
                    decimals=3,
                )
            )
            for cls, _, _, _, think in classes:
                if lifetime is None:
                    continue
                if think is None:
                    figures.append(
                        Figure(
                            f"{lk}.reuse.{cls}",
                            f"{name} @ {LOCAL_BACKEND}, {cls}: next turn within",
                            lifetime,
                            "s",
                            f"a conversation's next turn hits only if it arrives within the {_n(lifetime)} s "
                            f"lifetime; class {cls} declares no think_time_s to compare",
                            decimals=3,
                        )
                    )
                    continue
                hits = think <= lifetime
                figures.append(
                    Figure(
                        f"{lk}.reuse.{cls}",
                        f"{name} @ {LOCAL_BACKEND}, {cls}: think time",
                        think,
                        "s",
                        f"think_time_s {_n(think)} s {'<=' if hits else '>'} lifetime {_n(lifetime)} s: "
                        + (
                            "the next turn finds its prefix cached"
                            if hits
                            else "EVICTED: the next turn misses and prefills its whole prompt again"
                        ),
                        decimals=3,
                    )
                )
        else:
            for rate in TABLE_RATES:
                figures.append(
                    Figure(
                        f"{lk}.lifetime_s_at_{rate:.0f}",
                        f"{name} @ {LOCAL_BACKEND}: lifetime at {_n(rate)} tok/s",
                        tokens / rate,
                        "s",
                        f"{tokens:,} cached tokens / {_n(rate)} unique prompt tokens/s reaching it "
                        f"(no workload class calls {name}); a next turn hits only if it arrives within it "
                        "(no think time declared to compare)",
                        decimals=3,
                    )
                )
    return Section(TITLE, tuple(figures)) if figures else None
