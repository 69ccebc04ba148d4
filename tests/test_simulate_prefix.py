"""The simulator's chat arrivals and prefix report (issue 32): a scaled-down chat-prefix.yaml."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gateway.core.errors import ConfigError
from orchid_tools.simulate import simulate
from tests.conftest import ROOT

EXAMPLE = ROOT / "examples" / "orchid" / "simulate" / "chat-prefix.yaml"


def scaled(tmp_path: Path, **changes: object) -> Path:
    """chat-prefix.yaml, 20 s, two tenants sharing one system prompt, without expectations."""
    scenario = yaml.safe_load(EXAMPLE.read_text())
    scenario["gateway"] = str(EXAMPLE.parent.parent / "gateway.yaml")
    scenario["phases"] = [{"name": "chat", "duration_s": 20}]
    del scenario["arrivals"]["cedar"]
    scenario.pop("expect")
    scenario.update(changes)
    path = tmp_path / "chat.yaml"
    path.write_text(yaml.safe_dump(scenario))
    return path


def test_affinity_serves_more_of_the_prompts_from_cache_and_never_across_tenants(tmp_path: Path) -> None:
    document = simulate(scaled(tmp_path))
    runs = document["runs"]
    on = runs["prefix_affinity=true"]["phases"][0]["prefix"]["routes"]["chat"]
    off = runs["prefix_affinity=false"]["phases"][0]["prefix"]["routes"]["chat"]
    assert on["prefix_requests"] == off["prefix_requests"] > 100
    assert on["prefix_cached_token_pct"] > off["prefix_cached_token_pct"]
    assert on["prefix_device_ms_per_answered"] < off["prefix_device_ms_per_answered"]
    assert on["prefix_extra_wait_ms_max"] <= 20.0
    assert off["prefix_spills"] == 0 and off["prefix_extra_wait_ms_max"] == 0.0
    for run in runs.values():
        # acme and birch send the same system prompt: their scopes keep them apart.
        assert run["phases"][0]["prefix"]["routes"]["chat"]["prefix_cross_tenant_hits"] == 0
        assert run["prefix"]["scopes_shared_by_tenants"] == []
        assert run["prefix"]["scopes_sent"] == 2
        backends = run["phases"][0]["prefix"]["backends"]
        assert sum(c["lookups"] for c in backends.values()) == on["prefix_requests"]
    # The gateway's own counters agree with what the backends reported.
    counters = runs["prefix_affinity=true"]["prefix"]["gateway_counters"]["chat"]
    assert counters["cached_tokens"] == on["prefix_cached_tokens"]


def test_the_same_scenario_gives_the_same_report(tmp_path: Path) -> None:
    path = scaled(tmp_path, compare=None, phases=[{"name": "chat", "duration_s": 5}])
    assert simulate(path) == simulate(path)


def test_a_chat_class_takes_no_input_tokens_and_says_where(tmp_path: Path) -> None:
    scenario = yaml.safe_load(scaled(tmp_path).read_text())
    scenario["arrivals"]["birch"]["input_tokens"] = 256
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(scenario))
    with pytest.raises(ConfigError, match=r"bad\.yaml:\d+:\d+: arrivals\.birch\.input_tokens: a chat's"):
        simulate(path)
    scenario["arrivals"]["birch"].pop("input_tokens")
    scenario["arrivals"]["birch"]["chat"] = {**scenario["arrivals"]["birch"]["chat"], "turns": [5, 2]}
    path.write_text(yaml.safe_dump(scenario))
    with pytest.raises(ConfigError, match=r"arrivals\.birch\.chat\.turns: a range \[low, high\]"):
        simulate(path)
