"""The capacity emulator's prefix cache (``chat-v1``; issue 32), against a real Triton.

The cache is per server and model, shared by the model's instances, in SQLite at
``$ORCHID_PREFIX_CACHE_DIR/<model>.prefix.sqlite`` (LocalTriton: ``<workdir>/prefix-cache``).
The tests read its ``stats`` table directly (schema: the emulator's module docstring) and the
cached tokens each response reports (output ``PREFIX_CACHED_TOKENS``); never latency.
"""

from __future__ import annotations

import re
import shutil
import sqlite3
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from gateway.backends.local import LocalTriton
from tests.conftest import MODEL_REPOSITORY, emulator_parameters, own_triton

Tokens = npt.NDArray[np.int32]
MODEL = "chat-v1"
BLOCK = 16
TIME_FACTOR = 0.05


def prompt(first: int, n: int) -> Tokens:
    """``n`` tokens from ``first`` on: prompts with different ``first`` differ in block 0."""
    return np.arange(first, first + n, dtype=np.int32)


def infer(
    client: grpcclient.InferenceServerClient,
    tokens: Tokens,
    *,
    model: str = MODEL,
    scope: Any = None,
    max_output_tokens: int = 4,
) -> Tokens:
    """Each row's cached tokens, as the response reports them."""
    ids = tokens.reshape(1, -1) if tokens.ndim == 1 else tokens
    inp = grpcclient.InferInput("INPUT_IDS", list(ids.shape), "INT32")
    inp.set_data_from_numpy(ids)
    parameters: dict[str, Any] = {"max_output_tokens": max_output_tokens}
    if scope is not None:
        parameters["prefix_scope"] = scope
    result = client.infer(model, [inp], parameters=parameters)
    cached = result.as_numpy("PREFIX_CACHED_TOKENS")
    assert cached is not None and cached.shape == (ids.shape[0], 1)
    return np.asarray(cached[:, 0], dtype=np.int32)


def cached_tokens(client: grpcclient.InferenceServerClient, tokens: Tokens, **kw: Any) -> int:
    return int(infer(client, tokens, **kw)[0])


def stats(server: LocalTriton, model: str = MODEL) -> dict[str, int]:
    path = server.workdir / "prefix-cache" / f"{model}.prefix.sqlite"
    with sqlite3.connect(path) as db:
        return dict(db.execute("SELECT name, value FROM stats").fetchall())


def blocks(server: LocalTriton, model: str) -> int:
    path = server.workdir / "prefix-cache" / f"{model}.prefix.sqlite"
    with sqlite3.connect(path) as db:
        return int(db.execute("SELECT COUNT(*) FROM blocks").fetchone()[0])


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after if k != "clock"}


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalTriton]:
    with own_triton(tmp_path_factory.mktemp("chat"), time_factor=TIME_FACTOR, models=(MODEL,)) as server:
        yield server


@pytest.fixture
def client(chat: LocalTriton) -> Iterator[grpcclient.InferenceServerClient]:
    with grpcclient.InferenceServerClient(chat.address) as c:
        yield c


def test_chat_v1_declares_the_contract() -> None:
    declared = emulator_parameters(MODEL)
    assert declared["prefix_block_tokens"] == str(BLOCK)
    assert declared["prefix_cache_blocks"] == "4096"
    full = emulator_parameters("full-v18")
    assert {k: declared[k] for k in full} == full  # full-v18's cost profile and device memory


def test_the_same_prompt_twice_hits(chat: LocalTriton, client: grpcclient.InferenceServerClient) -> None:
    before = stats(chat)
    assert cached_tokens(client, prompt(1000, 40), scope="repeat") == 0
    assert cached_tokens(client, prompt(1000, 40), scope="repeat") == 32  # two full blocks of 40 tokens
    assert delta(before, stats(chat)) == {
        "lookups": 2,
        "hits": 1,
        "hit_blocks": 2,
        "miss_blocks": 2,
        "inserted": 2,
        "evictions": 0,
    }
    # A prompt of whole blocks: at least one token is always computed.
    assert cached_tokens(client, prompt(1100, 48), scope="repeat") == 0
    assert cached_tokens(client, prompt(1100, 48), scope="repeat") == 47


def test_the_scope_is_part_of_the_key(chat: LocalTriton, client: grpcclient.InferenceServerClient) -> None:
    tokens = prompt(2000, 50)
    assert cached_tokens(client, tokens, scope="tenant-a") == 0
    assert cached_tokens(client, tokens, scope="tenant-a") == 48
    before = stats(chat)
    assert cached_tokens(client, tokens, scope="tenant-b") == 0
    assert delta(before, stats(chat))["hits"] == 0
    # No scope is the scope "": a direct client's requests share it.
    assert cached_tokens(client, tokens) == 0
    assert cached_tokens(client, tokens) == 48
    assert cached_tokens(client, tokens, scope="") == 48


def test_a_shared_prefix_hits_only_its_common_blocks(client: grpcclient.InferenceServerClient) -> None:
    base = prompt(3000, 5 * BLOCK + 3)
    assert cached_tokens(client, base, scope="p") == 0
    diverging = base.copy()
    diverging[3 * BLOCK + 5] += 1  # the same first three blocks, a different fourth
    assert cached_tokens(client, diverging, scope="p") == 3 * BLOCK
    first_block = base.copy()
    first_block[0] += 1  # block 0 differs: no later block can match
    assert cached_tokens(client, first_block, scope="p") == 0
    # The diverging prompt's own blocks were inserted: it now hits in full.
    assert cached_tokens(client, diverging, scope="p") == 5 * BLOCK


def test_each_row_is_a_sequence_of_its_own(
    chat: LocalTriton, client: grpcclient.InferenceServerClient
) -> None:
    warm = prompt(4000, 40)
    assert cached_tokens(client, warm, scope="rows") == 0
    before = stats(chat)
    both = np.stack([warm, prompt(5000, 40)])
    assert infer(client, both, scope="rows").tolist() == [32, 0]
    assert delta(before, stats(chat)) == {
        "lookups": 2,
        "hits": 1,
        "hit_blocks": 2,
        "miss_blocks": 2,
        "inserted": 2,
        "evictions": 0,
    }


@pytest.mark.parametrize("scope", [3, True])
def test_a_bad_prefix_scope_is_an_error_naming_it(
    chat: LocalTriton, client: grpcclient.InferenceServerClient, scope: Any
) -> None:
    before = stats(chat)
    with pytest.raises(InferenceServerException, match="prefix_scope"):
        infer(client, prompt(6000, 40), scope=scope)
    assert delta(before, stats(chat))["lookups"] == 0


def test_the_instances_share_one_cache(chat: LocalTriton, client: grpcclient.InferenceServerClient) -> None:
    """chat-v1 has two instances. While a long request holds one, a prompt runs on the other;
    then a second long request holds that other one, the first is cancelled (the emulator frees
    its instance at once), and the prompt's repeat runs on the first instance: a hit. Each "is
    executing" is a condition (its lookup counted), each "still holds" is checked; no timing."""
    hold_tokens = 250_000  # ~5 s of decode at the time factor; each is cancelled long before

    def executing(lookups: int) -> None:
        deadline = time.monotonic() + 30
        while stats(chat)["lookups"] < lookups:
            assert time.monotonic() < deadline, "the long request never started"
            time.sleep(0.002)

    def send_long(first: int) -> tuple[Future[None], Any]:
        future: Future[None] = Future()
        ids = prompt(first, 20).reshape(1, -1)
        inp = grpcclient.InferInput("INPUT_IDS", list(ids.shape), "INT32")
        inp.set_data_from_numpy(ids)
        call = client.async_infer(
            MODEL,
            [inp],
            callback=lambda result, error: future.set_result(None),
            parameters={"max_output_tokens": hold_tokens, "prefix_scope": "hold"},
        )
        return future, call

    tokens = prompt(7000, 40)
    base = stats(chat)["lookups"]
    first, first_call = send_long(70_000)
    second, second_call = None, None
    try:
        executing(base + 1)  # the first long request holds one instance
        assert cached_tokens(client, tokens, scope="shared") == 0  # so this ran on the other
        second, second_call = send_long(80_000)
        executing(base + 3)  # on the other instance: the first one is still held
        assert not first.done(), "the first long request ended too soon for the test's premise"
        first_call.cancel()
        first.result(timeout=30)
        assert cached_tokens(client, tokens, scope="shared") == 32  # on the first instance: a hit
        assert not second.done(), "the second long request ended too soon for the test's premise"
    finally:
        first_call.cancel()
        if second_call is not None:
            second_call.cancel()
    assert second is not None
    second.result(timeout=30)


def small_repository(root: Path) -> Path:
    """chat-v1 with 8 cache blocks and one instance, and two copies of it that must not load."""
    repository = root / "repo" / "model_repository"
    source = (MODEL_REPOSITORY / MODEL / "config.pbtxt").read_text()

    def copy(name: str, text: str) -> None:
        shutil.copytree(MODEL_REPOSITORY / MODEL, repository / name)
        text = text.replace(f'name: "{MODEL}"', f'name: "{name}"').replace("count: 2", "count: 1")
        (repository / name / "config.pbtxt").write_text(text)

    def parameter(key: str, value: str | None, text: str) -> str:
        line = re.compile(rf'  \{{ key: "{key}", value: \{{ string_value: "[^"]*" \}} \}},\n')
        assert line.search(text), key
        new = f'  {{ key: "{key}", value: {{ string_value: "{value}" }} }},\n' if value is not None else ""
        return line.sub(new, text)

    copy("chat-small", parameter("prefix_cache_blocks", "8", source))
    copy("chat-missing", parameter("prefix_cache_blocks", None, source))
    copy("chat-zero", parameter("prefix_block_tokens", "0", source))
    shutil.copytree(MODEL_REPOSITORY.parent / "emulator", root / "repo" / "emulator")
    return repository


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalTriton]:
    root = tmp_path_factory.mktemp("small")
    stale = root / "triton" / "prefix-cache" / "chat-small.prefix.sqlite"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"a previous server's cache")
    server = LocalTriton(
        small_repository(root),
        root / "triton",
        time_factor=TIME_FACTOR,
        extra_args=("--exit-on-error=false", "--strict-readiness=false"),
    )
    server.start()
    try:
        yield server
    finally:
        server.kill()  # disposable: see conftest.own_triton


def test_local_triton_starts_each_server_cold(chat: LocalTriton, small: LocalTriton) -> None:
    """Each server its own <workdir>/prefix-cache, emptied at start (small's held a stale file)."""
    assert chat.workdir / "prefix-cache" != small.workdir / "prefix-cache"
    assert "lookups" in stats(small, "chat-small")  # not the stale bytes: a fresh database
    assert sorted(p.name for p in (small.workdir / "prefix-cache").glob("*.sqlite")) == [
        "chat-small.prefix.sqlite"
    ]


def test_bad_cache_parameters_fail_the_load_naming_them(small: LocalTriton) -> None:
    with grpcclient.InferenceServerClient(small.address) as c:
        index = {m["name"]: m for m in c.get_model_repository_index(as_json=True)["models"]}
    assert index["chat-small"]["state"] == "READY"
    assert index["chat-missing"]["state"] == "UNAVAILABLE"
    assert "prefix_cache_blocks" in index["chat-missing"]["reason"]
    assert index["chat-zero"]["state"] == "UNAVAILABLE"
    assert "prefix_block_tokens" in index["chat-zero"]["reason"]


def test_the_least_recently_used_blocks_are_evicted(small: LocalTriton) -> None:
    p, q, r = prompt(100, 4 * BLOCK + 1), prompt(200, 4 * BLOCK + 1), prompt(300, 4 * BLOCK + 1)
    before = stats(small, "chat-small")
    with grpcclient.InferenceServerClient(small.address) as c:

        def run(tokens: Tokens) -> int:
            return cached_tokens(c, tokens, model="chat-small")

        assert run(p) == 0
        assert run(q) == 0  # 8 blocks: full, nothing evicted
        assert stats(small, "chat-small")["evictions"] == before["evictions"]
        assert run(p) == 4 * BLOCK  # p is now more recent than q
        assert run(r) == 0  # 12 blocks > 8: q's four, the least recently used, go
        assert stats(small, "chat-small")["evictions"] == before["evictions"] + 4
        assert blocks(small, "chat-small") == 8
        assert run(p) == 4 * BLOCK
        assert run(q) == 0  # evicted; inserting it again evicts r, now the least recently used
        assert run(r) == 0
        assert delta(before, stats(small, "chat-small")) == {
            "lookups": 7,
            "hits": 2,
            "hit_blocks": 8,
            "miss_blocks": 20,
            "inserted": 20,
            "evictions": 12,
        }
