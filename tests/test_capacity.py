"""The capacity worksheet: the seed's figures from the shipped Orchid fixture, by computation."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.core.errors import ConfigError
from orchid_tools import cli
from orchid_tools.capacity import Worksheet, compute_worksheet, load_workload, workload_from_data

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "examples" / "orchid" / "workload.yaml"


@pytest.fixture(scope="module")
def sheet() -> Worksheet:
    return compute_worksheet(load_workload(FIXTURE), source=str(FIXTURE))


def _fixture_data() -> dict[str, Any]:
    data = yaml.safe_load(FIXTURE.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


def _write(tmp_path: Path, data: Any, name: str = "workload.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def _no_nan(text: str) -> None:
    assert not re.search(r"\b(nan|inf|infinity)\b", text, re.IGNORECASE), text


# --------------------------------------------------------------------------- the seed's figures


def test_memory_figures_follow_the_seed(sheet: Worksheet) -> None:
    assert round(sheet.value("memory.full-v18.weights_gib"), 2) == 26.08
    assert round(sheet.value("memory.full-v18.live_state_gib"), 2) == 47.92
    assert sheet.value("memory.full-v18.live_tokens") == 392_584


def test_scheduling_and_batching_figures_follow_the_seed(sheet: Worksheet) -> None:
    assert sheet.value("scheduling.max_batch_wait_ms") == 68
    assert sheet.value("batching.useful_tokens") == 5_888
    assert sheet.value("batching.padded_tokens") == 32_768
    assert round(sheet.value("batching.amplification"), 3) == 5.565
    # padded: 4.4 + 0.1 * 8 * 4096 + 0.41875 * 128; bucketed: (4.4 + 0.1 * 7 * 256 + 26.8) + 467.6
    assert sheet.value("batching.padded_batch_ms") == pytest.approx(3334.8)
    assert sheet.value("batching.bucketed_ms") == pytest.approx(678.0)


def test_execution_figures_follow_the_seed(sheet: Worksheet) -> None:
    assert sheet.value("execution.cost.short.full-v18") == pytest.approx(56.8)
    assert sheet.value("execution.cost.long.full-v18") == pytest.approx(467.6)
    assert sheet.value("execution.cost.short.compact-v11") == pytest.approx(32.0)
    assert sheet.value("execution.cost.long.compact-v11") == pytest.approx(239.2)
    assert round(sheet.value("execution.offered_demand"), 1) == 16_368.8
    assert sheet.value("execution.per_device") == 700
    assert sheet.value("execution.min_devices") == 24
    assert sheet.value("execution.fleet") == 24
    assert round(sheet.value("execution.protected_pct"), 2) == 97.43


def test_overload_figures_follow_the_seed(sheet: Worksheet) -> None:
    assert round(sheet.value("overload.surge_demand"), 1) == 20_461.0
    assert round(sheet.value("overload.fallback_saving"), 1) == 5_173.5
    assert round(sheet.value("overload.remaining_demand"), 1) == 15_287.5
    assert round(sheet.value("overload.remaining_pct"), 3) == 90.997


def test_sections_follow_the_seed_worksheet_headings(sheet: Worksheet) -> None:
    titles = [s.title for s in sheet.sections]
    assert titles[0] == "Outcome and workload"
    assert titles[1] == "Execution"
    assert titles[2].startswith("Memory")
    assert titles[3:5] == ["Scheduling and batching", "Quality and overload"]
    # Then the seed's combined bottlenecks, one section each (the fixture declares them all).
    assert titles[5:] == [
        "Combination: normal traffic plus shadow",
        "Combination: version overlap plus long sequences",
        "Combination: one device-group loss plus cold load",
        "Combination: surge plus fallback",
        "Combination: feature latency plus batch dwell",
    ]
    for figure in sheet.figures:
        assert figure.unit is not None and figure.explanation and "\n" not in figure.explanation


# --------------------------------------------------------------------------- command line


def test_cli_text_prints_the_seed_figures(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["capacity", str(FIXTURE)]) == 0
    out = capsys.readouterr().out
    for expected in (
        "26.08 GiB",
        "47.92 GiB",
        "392,584 tokens",
        "5,888 tokens",
        "32,768 tokens",
        "5.565×",
        "68 ms",
        "16,368.8 accelerator-ms/s",
        "700 ms/s",
        "24 devices",
        "97.43 %",
        "20,461.0 accelerator-ms/s",
        "5,173.5 accelerator-ms/s",
        "15,287.5 accelerator-ms/s",
        "90.997 %",
        "56.8 accelerator-ms",
        "467.6 accelerator-ms",
        "3,334.8 accelerator-ms",
        "678.0 accelerator-ms",
    ):
        assert expected in out, expected
    for heading in ("Memory", "Scheduling and batching", "Execution", "Quality and overload"):
        assert re.search(rf"^{heading}", out, re.MULTILINE), heading
    _no_nan(out)


def test_cli_text_columns_are_aligned(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["capacity", str(FIXTURE)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    # the value column ends at the same offset on every row
    ends = {re.search(r"^  .+?\s{2,}(\S.*?)  \S", row).end(1) for row in rows}  # type: ignore[union-attr]
    assert len(ends) == 1


def test_cli_json_emits_the_same_figures(capsys: pytest.CaptureFixture[str], sheet: Worksheet) -> None:
    assert cli.main(["capacity", str(FIXTURE), "--json"]) == 0
    out = capsys.readouterr().out
    _no_nan(out)
    data = json.loads(out)
    figures = {f["key"]: f for s in data["sections"] for f in s["figures"]}
    assert set(figures) == {f.key for f in sheet.figures}
    assert figures["memory.full-v18.live_tokens"]["value"] == 392_584
    assert figures["execution.min_devices"]["value"] == 24
    assert figures["scheduling.max_batch_wait_ms"]["value"] == 68
    assert round(figures["execution.offered_demand"]["value"], 1) == 16_368.8
    assert round(figures["overload.remaining_pct"]["value"], 3) == 90.997
    assert figures["overload.remaining_pct"]["display"] == "90.997 %"
    assert figures["batching.amplification"]["unit"] == "×"
    for figure in figures.values():
        assert set(figure) == {"key", "label", "value", "unit", "display", "explanation"}
        assert figure["explanation"]


# --------------------------------------------------------------------------- a different workload

SECOND = {
    "device": {"memory_gib": 40, "runtime_reserve_gib": 4, "protected_utilization": 0.5, "devices": 10},
    "models": {
        "m7": {
            "fixed_ms": 2.0,
            "prefill_ms_per_token": 0.02,
            "decode_ms_per_token": 0.5,
            "weights_bytes": 16 * 1024**3,
            "live_cache_bytes_per_token": 65536,
        },
        "tiny": {
            "fixed_ms": 1.0,
            "prefill_ms_per_token": 0.01,
            "decode_ms_per_token": 0.1,
            "params": 7e9,
            "bytes_per_param": 0.5,
            "quality_score": 0.7,
            "quality_floor": 0.8,
        },
    },
    "classes": {
        "chat": {"rate_per_s": 50, "input_tokens": 512, "output_tokens": 256, "model": "m7"},
        "bulk": {
            "rate_per_s": 0,
            "input_tokens": 100,
            "output_tokens": 10,
            "model": "m7",
            "fallback": "tiny",
        },
    },
    "overload": {"surge_factor": 2.0, "fallback_share": {"bulk": 1.0}},
}


def test_a_different_workload_is_computed_not_recited(tmp_path: Path) -> None:
    sheet = compute_worksheet(load_workload(_write(tmp_path, SECOND)))
    cost = 2.0 + 0.02 * 512 + 0.5 * 256  # 140.24
    assert sheet.value("execution.cost.chat.m7") == pytest.approx(cost)
    assert sheet.value("execution.offered_demand") == pytest.approx(50 * cost)
    assert sheet.value("execution.per_device") == 500
    assert sheet.value("execution.min_devices") == math.ceil(50 * cost / 500) == 15
    assert sheet.value("execution.fleet") == 10  # declared, not the minimum
    assert sheet.value("execution.protected_pct") == pytest.approx(50 * cost / 5000 * 100)
    assert sheet.value("overload.surge_demand") == pytest.approx(2 * 50 * cost)
    # bulk has no arrivals; tiny is below its quality floor, so nothing is saved
    assert sheet.value("overload.fallback_saving") == 0
    assert sheet.value("overload.remaining_pct") == pytest.approx(2 * 50 * cost / 5000 * 100)
    assert "BELOW floor" in sheet.figure("overload.saving.bulk").explanation
    assert sheet.value("memory.m7.weights_gib") == 16
    assert sheet.value("memory.m7.live_state_gib") == 20
    assert sheet.value("memory.m7.live_tokens") == 20 * 1024**3 // 65536
    assert sheet.value("memory.tiny.weights_gib") == pytest.approx(3.5e9 / 1024**3)
    assert sheet.figure("memory.tiny.live_tokens").value is None  # no live cache declared
    assert all(s.title != "Scheduling and batching" for s in sheet.sections)  # neither declared


def test_degenerate_workload_prints_no_nan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = {
        "device": {"memory_gib": 1, "protected_utilization": 1.0},
        "models": {
            "free": {
                "fixed_ms": 0,
                "prefill_ms_per_token": 0,
                "decode_ms_per_token": 0,
                "weights_bytes": 2**31,
            },
        },
        "classes": {"idle": {"rate_per_s": 0, "input_tokens": 0, "output_tokens": 0, "model": "free"}},
        "deadline": {"deadline_ms": 10, "elapsed_ms": 20},
        "padding_example": {"model": "free", "input_tokens": [1], "output_tokens": [0]},
    }
    path = _write(tmp_path, data)
    assert cli.main(["capacity", str(path)]) == 0
    text = capsys.readouterr().out
    assert cli.main(["capacity", str(path), "--json"]) == 0
    raw = capsys.readouterr().out
    _no_nan(text + raw)
    sheet = compute_worksheet(load_workload(path))
    assert sheet.value("execution.min_devices") == 0
    assert sheet.value("execution.fleet") == 1
    assert sheet.value("memory.free.live_state_gib") == -1  # weights exceed the device
    assert "DOES NOT FIT" in sheet.figure("memory.free.live_state_gib").explanation
    assert sheet.value("scheduling.max_batch_wait_ms") == -10
    assert "NEGATIVE" in sheet.figure("scheduling.max_batch_wait_ms").explanation
    assert sheet.figure("batching.padding_cost_ratio").value is None
    assert "n/a" in text


# --------------------------------------------------------------------------- bad input


def _mutate(path: list[str], value: Any) -> dict[str, Any]:
    data = _fixture_data()
    node = data
    for part in path[:-1]:
        node = node[part]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return data


_DELETE = object()

BAD = [
    pytest.param(["classes", "short", "output_tokens"], _DELETE, "classes.short.output_tokens", id="missing"),
    pytest.param(["classes", "long", "rate_per_s"], -18, "classes.long.rate_per_s", id="negative-rate"),
    pytest.param(
        ["device", "protected_utilization"], 0, "device.protected_utilization", id="zero-protected-util"
    ),
    pytest.param(["device", "memory_gib"], 0, "device.memory_gib", id="zero-device-memory"),
    pytest.param(["device", "devices"], 0, "device.devices", id="zero-devices"),
    pytest.param(["classes", "short", "model"], "full-v19", "classes.short.model", id="unknown-model"),
    pytest.param(["classes", "long", "fallback"], "nope", "classes.long.fallback", id="unknown-fallback"),
    pytest.param(["overload", "fallback_share", "short"], 1.5, "overload.fallback_share.short", id="share>1"),
    pytest.param(["padding_example", "model"], "ghost", "padding_example.model", id="unknown-padding-model"),
    pytest.param(["deadline", "surprise"], 1, "deadline.surprise", id="unknown-field"),
]


@pytest.mark.parametrize(("path", "value", "key"), BAD)
def test_bad_workload_exits_2_naming_file_and_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], path: list[str], value: Any, key: str
) -> None:
    file = _write(tmp_path, _mutate(path, value))
    assert cli.main(["capacity", str(file)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    message = captured.err.strip()
    assert message.startswith(f"{file}:"), message
    assert f": {key}: " in message, message
    _no_nan(message)
    with pytest.raises(ConfigError) as info:
        load_workload(file)
    assert info.value.key == key


def test_yaml_syntax_error_exits_2_with_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = tmp_path / "broken.yaml"
    file.write_text("device: {memory_gib: 80\nmodels: [\n", encoding="utf-8")
    assert cli.main(["capacity", str(file)]) == 2
    message = capsys.readouterr().err.strip()
    assert message.startswith(f"{file}:2:"), message
    assert "YAML syntax error" in message


@pytest.mark.parametrize("text", ["", "- just\n- a list\n"], ids=["empty", "list"])
def test_non_mapping_document_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str) -> None:
    file = tmp_path / "odd.yaml"
    file.write_text(text, encoding="utf-8")
    assert cli.main(["capacity", str(file)]) == 2
    assert capsys.readouterr().err.startswith(f"{file}: expected a mapping")


def test_unreadable_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "absent.yaml"
    assert cli.main(["capacity", str(missing)]) == 2
    assert capsys.readouterr().err.startswith(f"{missing}: cannot read file")


def test_error_points_at_the_line_of_the_key(tmp_path: Path) -> None:
    text = FIXTURE.read_text(encoding="utf-8").replace("rate_per_s: 18", "rate_per_s: -18")
    file = tmp_path / "w.yaml"
    file.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_workload(file)
    line = next(i for i, row in enumerate(text.splitlines(), 1) if "rate_per_s: -18" in row)
    assert info.value.location.startswith(f"{file}:{line}:")
    assert "greater than or equal to 0" in info.value.problem


def test_params_and_weights_bytes_are_exclusive() -> None:
    data = _fixture_data()
    data["models"]["full-v18"]["weights_bytes"] = 1
    with pytest.raises(ConfigError) as info:
        workload_from_data(data, "inline.yaml")
    assert info.value.key == "models.full-v18.weights_bytes"
