"""gateway.core.prefix: scoped block keys, the pool index, the learned hit rate and the
bounded-load choice (pure; no backend)."""

from __future__ import annotations

import struct

from hypothesis import given
from hypothesis import strategies as st

from gateway.core.prefix import (
    HitRate,
    Option,
    PrefixIndex,
    block_keys,
    cached_tokens,
    choose,
    scope_for,
)


def tokens(values: list[int]) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)


PROMPT = list(range(100, 164))  # 64 tokens: 4 blocks of 16


def test_keys_chain_the_whole_prefix_and_the_scope() -> None:
    a = scope_for("orchid", "eu", "chat-v1", "1")
    keys = block_keys(a, tokens(PROMPT), 16)
    assert len(keys) == 4
    # A prompt sharing the first two blocks shares exactly their keys.
    other = PROMPT[:32] + [7] * 32
    shared = block_keys(a, tokens(other), 16)
    assert shared[:2] == keys[:2] and shared[2] != keys[2] and shared[3] != keys[3]
    # A change in block 0 changes every key after it (chained), even where the tokens agree.
    changed = [1, *PROMPT[1:]]
    assert all(x != y for x, y in zip(block_keys(a, tokens(changed), 16), keys, strict=True))
    # A partial tail block has no key.
    assert len(block_keys(a, tokens([*PROMPT, 1, 2, 3]), 16)) == 4


@given(
    st.lists(st.integers(0, 31_999), min_size=16, max_size=80),
    st.sampled_from(["orchid", "lumen"]),
    st.sampled_from(["eu", "us"]),
    st.sampled_from(["1", "2"]),
)
def test_no_key_is_shared_across_scopes(prompt: list[int], tenant: str, cell: str, version: str) -> None:
    """The same prompt under any other tenant, cell or model version shares no block key."""
    mine = set(block_keys(scope_for(tenant, cell, "chat-v1", version), tokens(prompt), 16))
    for other_tenant in ("orchid", "lumen", "kestrel"):
        for other_cell in ("eu", "us"):
            for other_version in ("1", "2"):
                if (other_tenant, other_cell, other_version) == (tenant, cell, version):
                    continue
                scope = scope_for(other_tenant, other_cell, "chat-v1", other_version)
                assert not mine & set(block_keys(scope, tokens(prompt), 16))


def test_cached_tokens_leave_one_token_to_compute() -> None:
    assert cached_tokens(4, 16, 64) == 63
    assert cached_tokens(2, 16, 64) == 32
    assert cached_tokens(0, 16, 64) == 0


def test_index_is_a_bounded_lru() -> None:
    index = PrefixIndex(capacity_blocks=4)
    a = block_keys("s", tokens(PROMPT[:32]), 16)  # 2 blocks
    b = block_keys("s", tokens([9] * 32), 16)  # 2 blocks
    c = block_keys("s", tokens([8] * 32), 16)
    index.record(a)
    index.record(b)
    assert index.match(a) == 2 and index.match(b) == 2
    index.record(a)  # a is now the most recent
    index.record(c)  # evicts b (least recently used), not a
    assert index.match(a) == 2 and index.match(b) == 0 and index.match(c) == 2
    assert index.evictions == 2 and len(index) == 4


def test_the_rate_follows_what_the_backend_reports() -> None:
    rates = HitRate(alpha=0.5)
    assert rates.expected_tokens("chat", "orchid", 48) == 48  # the prior: believe the index
    rates.observe("chat", "orchid", 48, 0)  # the backend reported no hit
    assert rates.expected_tokens("chat", "orchid", 48) == 0
    for _ in range(6):
        rates.observe("chat", "orchid", 48, 48)
    assert rates.expected_tokens("chat", "orchid", 48) >= 46
    assert rates.rate("chat", "lumen") == 1.0  # per tenant


def test_choose_prefers_the_saving_inside_the_bound() -> None:
    options = [Option(wait_ms=0.0, saving_ms=0.0), Option(wait_ms=8.0, saving_ms=5.0)]
    assert choose(options, 0, 10.0).index == 1
    spilled = choose(options, 0, 5.0)
    assert spilled.index == 0 and spilled.spilled
    assert choose([Option(0.0, 0.0), Option(0.0, 0.0)], 1, 10.0).index == 1  # no saving: least


@given(
    st.lists(
        st.tuples(st.floats(0, 200, allow_nan=False), st.floats(0, 50, allow_nan=False)),
        min_size=1,
        max_size=6,
    ),
    st.floats(0, 50, allow_nan=False),
    st.data(),
)
def test_choice_never_exceeds_the_bound(
    raw: list[tuple[float, float]], bound: float, data: st.DataObject
) -> None:
    """Whatever the savings: the pick's predicted wait is within the bound of the least-loaded
    pick's, no pool inside the bound saves more, and a spill is reported exactly when a better
    saving lay outside it."""
    options = [Option(wait_ms=w, saving_ms=s) for w, s in raw]
    least = data.draw(
        st.sampled_from([i for i, o in enumerate(options) if o.wait_ms == min(o.wait_ms for o in options)])
    )
    choice = choose(options, least, bound)
    floor = options[least].wait_ms
    picked = options[choice.index]
    assert picked.wait_ms <= floor + bound
    inside = [o.saving_ms for o in options if o.wait_ms <= floor + bound]
    assert picked.saving_ms == max(inside) or (max(inside) <= 0.0 and choice.index == least)
    best = max(o.saving_ms for o in options)
    assert choice.spilled == (best > 0.0 and best > picked.saving_ms)
    assert choice.extra_wait_ms == picked.wait_ms - floor
