"""The worksheet's "Prefix cache" section (orchid_tools.capacity_prefix) for the example gateway
config: route chat (backend chat-v1, profile full-v18) and chat-v1's declared cache, every figure
hand-derived here from examples/orchid/model_repository/chat-v1/config.pbtxt and routes/orchid.yaml."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import load_gateway_config, load_routes
from gateway.core.prefix import declared_cache
from orchid_tools.capacity import compute_worksheet, load_workload, with_gateway, workload_from_data
from orchid_tools.capacity_prefix import model_parameters, prefix_section
from orchid_tools.cli import main
from tests.conftest import MODEL_REPOSITORY, ROOT

WORKLOAD = ROOT / "examples" / "orchid" / "workload.yaml"
GATEWAY = ROOT / "examples" / "orchid" / "gateway.yaml"
GIB = 1024**3

# chat-v1: 4,096 blocks of 16 tokens = 65,536 tokens; full-v18: 131,072 B (128 KiB) per token.
TOKENS = 4096 * 16
CACHE = TOKENS * 131072  # 8,589,934,592 B = 8 GiB
# The example's local Triton: 80 GiB devices, 6 GiB reserve, chat-v1 on its own devices (no
# shared_devices) beside full-v18's 28e9 B of weights: 74 GiB - 28e9 B = 51,456,894,976 B (47.92 GiB).
ROOM = 80 * GIB - 6 * GIB - 28_000_000_000


def _config(tmp_path: Path, **changes: Any) -> Path:
    """The example gateway config, its paths made absolute, with ``changes`` applied."""
    data: dict[str, Any] = yaml.safe_load(GATEWAY.read_text())
    base = GATEWAY.parent
    for key in ("tenants_file", "routes_dir", "policies_dir"):
        data[key] = str((base / data[key]).resolve())
    data["local_triton"]["model_repository"] = str(
        (base / data["local_triton"]["model_repository"]).resolve()
    )
    for key in ("registry", "repo"):
        source = data["feature_sources"]["feast"]
        source[key] = str((base / source[key]).resolve())
    data.update(changes)
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _figures(config_path: Path, workload: Any = None) -> dict[str, Any]:
    config = load_gateway_config(config_path)
    section = prefix_section(config, load_routes(config.routes_dir), workload)
    assert section is not None and section.title == "Prefix cache"
    return {f.key: f for f in section.figures}


def test_the_reader_finds_chat_v1s_cache() -> None:
    parameters = model_parameters(MODEL_REPOSITORY, "chat-v1")
    spec = declared_cache(parameters)
    assert spec is not None and (spec.block_tokens, spec.capacity_blocks) == (16, 4096)
    assert declared_cache(model_parameters(MODEL_REPOSITORY, "full-v18")) is None
    assert declared_cache({"prefix_block_tokens": "16"}) is None  # one half: none
    assert declared_cache({"prefix_block_tokens": "16", "prefix_cache_blocks": "0"}) is None
    assert model_parameters(MODEL_REPOSITORY, "no-such-model") == {}


def test_the_shipped_example_holds_8_gib_and_tables_its_lifetime() -> None:
    figures = _figures(GATEWAY)
    value = {k: f.value for k, f in figures.items()}
    assert value["prefix.chat.tokens"] == TOKENS == 65_536
    assert value["prefix.chat.affinity_bound_ms"] == 20.0  # routes/orchid.yaml's prefix_affinity
    assert value["prefix.chat.local.cache_bytes"] == CACHE == 8 * GIB
    assert figures["prefix.chat.local.cache_bytes"].explanation.startswith(
        "8 GiB = 4,096 blocks x 16 tokens x 131,072 B per token"
    )
    assert value["prefix.chat.local.live_room"] == ROOM
    assert value["prefix.chat.local.live_room_left"] == ROOM - CACHE  # 39.92 GiB
    left = figures["prefix.chat.local.live_room_left"].explanation
    assert "same device memory as live sequence state" in left and "fits" in left
    assert f"{(ROOM - CACHE) // 131072:,} live tokens left" in left  # 327,048
    # No workload class calls chat: the lifetime at 1k, 10k and 100k unique prompt tokens/s.
    assert value["prefix.chat.local.lifetime_s_at_1000"] == pytest.approx(65.536)
    assert value["prefix.chat.local.lifetime_s_at_10000"] == pytest.approx(6.5536)
    assert value["prefix.chat.local.lifetime_s_at_100000"] == pytest.approx(0.65536)
    assert "no think time declared" in figures["prefix.chat.local.lifetime_s_at_1000"].explanation
    assert not any(k.startswith("prefix.") and ".full-v18" in k for k in figures)  # no cache declared


def _chat_workload(think_time_s: float | None) -> Any:
    data: dict[str, Any] = yaml.safe_load(WORKLOAD.read_text())
    data["models"]["chat"] = dict(data["models"]["full-v18"])
    chat: dict[str, Any] = {"rate_per_s": 20, "input_tokens": 2048, "output_tokens": 64, "model": "chat"}
    chat["unique_input_tokens"] = 256
    if think_time_s is not None:
        chat["think_time_s"] = think_time_s
    data["classes"]["chat"] = chat
    return workload_from_data(data, "chat.yaml")


def test_the_lifetime_at_the_workloads_rate_and_the_reuse_condition() -> None:
    # 20 req/s x 256 unique prompt tokens = 5,120 tokens/s: 65,536 / 5,120 = 12.8 s.
    figures = _figures(GATEWAY, _chat_workload(think_time_s=8.0))
    assert figures["prefix.chat.local.unique_tokens_per_s"].value == pytest.approx(20 * 256)
    assert figures["prefix.chat.local.lifetime_s"].value == pytest.approx(TOKENS / (20 * 256)) == 12.8
    reuse = figures["prefix.chat.local.reuse.chat"]
    assert reuse.value == 8.0 and "finds its prefix cached" in reuse.explanation
    assert not any("lifetime_s_at_" in k for k in figures)
    slow = _figures(GATEWAY, _chat_workload(think_time_s=30.0))["prefix.chat.local.reuse.chat"]
    assert "EVICTED" in slow.explanation
    undeclared = _figures(GATEWAY, _chat_workload(think_time_s=None))["prefix.chat.local.reuse.chat"]
    assert undeclared.value == pytest.approx(12.8) and "declares no think_time_s" in undeclared.explanation


def test_a_config_without_a_cache_prints_no_section(tmp_path: Path) -> None:
    repository = tmp_path / "model_repository"
    (repository / "full-v18").mkdir(parents=True)
    (repository / "full-v18" / "config.pbtxt").write_text(
        (MODEL_REPOSITORY / "full-v18" / "config.pbtxt").read_text()
    )
    config_path = _config(tmp_path)
    data: dict[str, Any] = yaml.safe_load(config_path.read_text())
    data["local_triton"]["model_repository"] = str(repository)
    config_path.write_text(yaml.safe_dump(data))
    config = load_gateway_config(config_path)
    assert prefix_section(config, load_routes(config.routes_dir)) is None
    workload = load_workload(WORKLOAD)
    titles = [s.title for s in with_gateway(compute_worksheet(workload), workload, config_path).sections]
    assert "Prefix cache" not in titles


def test_remote_backends_say_they_cannot_see_model_configs(tmp_path: Path) -> None:
    remote = {
        "name": "triton-a",
        "address": "127.0.0.1:9",
        "labels": {"cell": "eu-restricted", "device_group": "a"},
        "devices": 2,
    }
    config_path = _config(tmp_path, backends=[remote])
    data: dict[str, Any] = yaml.safe_load(config_path.read_text())
    del data["local_triton"]
    config_path.write_text(yaml.safe_dump(data))
    figures = _figures(config_path)
    assert list(figures) == ["prefix.remote"]
    line = figures["prefix.remote"]
    assert line.value is None and "cannot see" in line.explanation and "triton-a" in line.explanation


def test_cli_prints_it_after_memory_and_before_upstream(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["capacity", str(WORKLOAD), "--gateway", str(GATEWAY)]) == 0
    out = capsys.readouterr().out
    titles = [x for x in out.splitlines() if x and not x.startswith(" ")]
    assert titles.index("Prefix cache") < titles.index("Upstream/downstream")
    assert titles.index("Prefix cache") > titles.index("Scheduling and batching")
    line = next(x for x in out.splitlines() if "chat @ local: cache held when full" in x)
    assert "8,589,934,592 B" in line and "8 GiB = 4,096 blocks x 16 tokens x 131,072 B" in line
    line = next(x for x in out.splitlines() if "lifetime at 1,000 tok/s" in x)
    assert "65.536 s" in line
