"""The live policy: keep-last-good on every kind of bad edit, atomic swap, watch, metrics."""

from __future__ import annotations

import asyncio
import importlib
import logging
import shutil
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from gateway.core.errors import Unavailable
from gateway.policy import metrics
from gateway.policy import store as store_module
from gateway.policy.store import PolicyStore
from gateway.policy.suites import build_inputs

GOOD = """\
rules:
  - id: deny-long
    stage: admission
    condition: shape.input_tokens > {limit}
    action: {{deny: {{status: RESOURCE_EXHAUSTED}}}}
"""


def write(directory: Path, text: str, name: str = "a.yaml") -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(text)


def reloads(result: str) -> float:
    return REGISTRY.get_sample_value("orchid_policy_reloads_total", {"result": result}) or 0.0


def test_not_ready_until_the_first_good_load(tmp_path: Path) -> None:
    store = PolicyStore(tmp_path / "policies")
    assert not store.ready and store.snapshot is None
    with pytest.raises(Unavailable):
        store.current()
    first = store.reload()
    assert not first.ok and not store.ready and store.failures == 1
    write(tmp_path / "policies", GOOD.format(limit=2048))
    second = store.reload()
    assert second.ok and store.ready and second.changed
    assert second.previous_version == "" and second.version == store.version


def test_bad_edit_keeps_the_last_good_snapshot_and_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = tmp_path / "policies"
    write(directory, GOOD.format(limit=2048))
    store = PolicyStore(directory)
    assert store.reload().ok
    good = store.snapshot
    failed_before = reloads("failed")
    write(directory, GOOD.format(limit=2048.5))
    with caplog.at_level(logging.ERROR, logger="gateway.policy"):
        result = store.reload()
    assert not result.ok
    assert store.snapshot is good and result.version == good.version and not result.changed
    assert result.attempted_version != good.version
    assert store.failures == 1 and reloads("failed") == failed_before + 1
    location = f"{directory / 'a.yaml'}:4:35"
    assert result.diagnostics[0].location == location
    assert any(location in message for message in caplog.messages)
    assert any("keeping sha256:" in message for message in caplog.messages)
    # the old policy still decides
    record, context = build_inputs({"shape": {"input_tokens": 4096}})
    assert store.current().evaluate(record, context).rule == "deny-long"


def test_half_written_file_keeps_the_last_good_snapshot(tmp_path: Path) -> None:
    directory = tmp_path / "policies"
    write(directory, GOOD.format(limit=2048))
    store = PolicyStore(directory)
    store.reload()
    good = store.snapshot
    full = GOOD.format(limit=1024)
    for cut in (0, len(full) // 3, len(full) - 40):
        write(directory, full[:cut])
        assert not store.reload().ok, cut
        assert store.snapshot is good
    write(directory, full)
    assert store.reload().ok and store.snapshot is not good


def test_directory_that_disappears_keeps_the_last_good_snapshot(tmp_path: Path) -> None:
    directory = tmp_path / "policies"
    write(directory, GOOD.format(limit=2048))
    store = PolicyStore(directory)
    store.reload()
    good = store.snapshot
    shutil.rmtree(directory)
    result = store.reload()
    assert not result.ok and store.snapshot is good
    assert result.diagnostics[0].message == "policy directory does not exist"
    write(directory, "rules: []\n")  # an empty rule list is valid: an explicit decision
    assert store.reload().ok and store.snapshot is not good


def test_good_edit_changes_the_version(tmp_path: Path) -> None:
    directory = tmp_path / "policies"
    write(directory, GOOD.format(limit=2048))
    store = PolicyStore(directory)
    first = store.reload()
    unchanged = store.reload()
    assert unchanged.ok and not unchanged.changed
    write(directory, GOOD.format(limit=4096))
    second = store.reload()
    assert second.ok and second.changed and second.previous_version == first.version
    write(directory, "label: tuesday\n", name="policy.yaml")
    third = store.reload()
    assert third.changed and store.current().label == "tuesday"


async def test_watch_reloads_on_change_and_reports_a_bad_edit_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "policies"
    write(directory, GOOD.format(limit=2048))
    store = PolicyStore(directory)
    polls = [0]  # the watcher's rounds: each reads the directory's hash once
    read_hash = store_module.directory_hash

    def counted(path: Path) -> str | None:
        polls[0] += 1
        return read_hash(path)

    monkeypatch.setattr(store_module, "directory_hash", counted)
    stop = asyncio.Event()
    task = asyncio.create_task(store.watch(0.02, stop=stop))

    async def until(predicate: object, timeout: float = 5.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while not predicate():  # type: ignore[operator]
            assert asyncio.get_running_loop().time() < deadline, "watch did not react"
            await asyncio.sleep(0.01)

    try:
        await until(lambda: store.ready)
        first = store.version
        write(directory, GOOD.format(limit="'x'"))
        await until(lambda: store.failures == 1)
        seen = polls[0]
        await until(lambda: polls[0] >= seen + 3)  # three more rounds over the same bad edit
        assert store.failures == 1 and store.version == first  # reported once, last good kept
        write(directory, GOOD.format(limit=512))
        await until(lambda: store.version != first)
    finally:
        stop.set()
        await asyncio.wait_for(task, 5.0)


def test_store_evaluate_observes_latency_and_fail_open(tmp_path: Path) -> None:
    directory = tmp_path / "policies"
    write(
        directory,
        """\
rules:
  - id: soft
    stage: quota
    on_error: allow
    condition: 1 / (shape.items - 1) > 0
    action: {deny: {status: RESOURCE_EXHAUSTED}}
""",
    )
    store = PolicyStore(directory)
    store.reload()
    count_before = REGISTRY.get_sample_value("orchid_policy_eval_seconds_count") or 0.0
    open_before = REGISTRY.get_sample_value("orchid_policy_fail_open_total", {"rule": "soft"}) or 0.0
    result = store.evaluate(*build_inputs({}))
    assert result.allowed and [f.rule for f in result.fail_open] == ["soft"]
    assert REGISTRY.get_sample_value("orchid_policy_eval_seconds_count") == count_before + 1
    assert REGISTRY.get_sample_value("orchid_policy_fail_open_total", {"rule": "soft"}) == open_before + 1


def test_metrics_module_can_be_imported_twice() -> None:
    before = metrics.POLICY_RELOADS
    reloaded = importlib.reload(metrics)
    assert reloaded.POLICY_RELOADS is before


def test_a_request_is_judged_by_the_snapshot_it_took_across_a_reload(tmp_path: Path) -> None:
    """Every candidate of one request (primary, fallback) is evaluated with the snapshot the
    request took, and counted in the evaluation metrics, even when a reload lands in between."""
    directory = tmp_path / "policies"
    write(directory, GOOD.format(limit=2048))
    store = PolicyStore(directory)
    assert store.reload().ok
    taken = store.current()
    write(directory, GOOD.format(limit=8192))
    assert store.reload().ok and store.current() is not taken
    record, context = build_inputs({"shape": {"input_tokens": 4096}})
    evaluated = REGISTRY.get_sample_value("orchid_policy_eval_seconds_count") or 0.0
    assert store.evaluate(record, context, taken).rule == "deny-long"  # the request's snapshot
    assert store.evaluate(record, context).rule != "deny-long"  # a new request: the live one
    assert REGISTRY.get_sample_value("orchid_policy_eval_seconds_count") == evaluated + 2
