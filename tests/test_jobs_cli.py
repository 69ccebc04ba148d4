"""``orchid-gateway jobs wait`` and ``batch get --watch`` show an operation's progress.

Against a gateway with a job store (``tests.test_jobs.jobs_gateway``): a batch submitted without
``--wait`` is followed by ``batch get ID --watch`` (its progress on stderr, a line per tenth off a
terminal, then the summary on stdout) and by ``jobs wait ID`` (the same progress, then the final
status on stdout)."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchid_tools import cli
from tests.conftest import ORCHID_KEY, ThreadedGateway
from tests.test_jobs import jobs_gateway, jsonl  # noqa: F401  # the module's gateway with jobs

ITEMS = 30


def _bars(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("[")]


def test_watch_and_wait_show_progress_until_done(
    jobs_gateway: ThreadedGateway,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("ORCHID_API_KEY", ORCHID_KEY)
    target = ["--target", jobs_gateway.address]
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(jsonl(ITEMS, prefix="watch"))
    assert cli.main(["batch", "submit", str(rows), "--model", "full-v18", *target]) == 0
    op_id = capsys.readouterr().out.strip()
    assert op_id.startswith("op-")

    assert cli.main(["batch", "get", op_id, "--watch", *target]) == 0
    captured = capsys.readouterr()
    bars = _bars(captured.err)
    assert bars, captured.err
    assert bars[-1].startswith("[" + "#" * 30 + f"] {ITEMS}/{ITEMS}") and bars[-1].endswith("completed")
    assert len(bars) <= 12  # off a terminal: a line per tenth and per status, not per item
    assert f"{op_id} completed: {ITEMS}/{ITEMS} completed, 0 failed" in captured.out

    assert cli.main(["jobs", "wait", op_id, *target]) == 0  # already done: one state, then the status
    captured = capsys.readouterr()
    assert _bars(captured.err)[-1].startswith("[" + "#" * 30 + f"] {ITEMS}/{ITEMS}")
    assert captured.out == f"completed {ITEMS}/{ITEMS}\n"
