"""The Feast feature server the feature-contract tests use (tests/feast_server.py), checked
against what examples/orchid/features/generate.py wrote: user 1's latest snapshot, user 7's
stale row (served as PRESENT, with its 3-day-old event timestamp) and user 8 (NOT_FOUND)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import httpx

from orchid_tools.featurestore import FeastServer

FEATURES = ("user_stats_v12__score", "user_stats_v12__clicks", "user_stats_v12__risk")


def _columns(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Feast's column-wise answer by feature name (its column order is not the schema's)."""
    names = body["metadata"]["feature_names"]
    return dict(zip(names, body["results"], strict=True))


def _at(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def test_online_features_for_present_stale_and_missing_users(feast_server: FeastServer) -> None:
    reply = httpx.post(
        f"{feast_server.url}/get-online-features",
        json={
            "feature_service": "ranker_v12",
            "entities": {"user_id": [1, 7, 8]},
            "full_feature_names": True,
        },
        timeout=10.0,
    )
    assert reply.status_code == 200, reply.text
    columns = _columns(reply.json())
    assert set(columns) == {"user_id", *FEATURES}
    assert columns["user_id"]["values"] == [1, 7, 8]
    now = feast_server.now
    values = {name: columns[name]["values"] for name in FEATURES}
    # user 1: its latest snapshot (1 h old) of three.
    assert [values[name][0] for name in FEATURES] == [11.0, 101, 0.015625]
    # user 7: only a 3-day-old row; Feast serves it (no ttl check on the online read).
    assert [values[name][1] for name in FEATURES] == [142.0, 772, 0.109375]
    # user 8: no rows.
    assert [values[name][2] for name in FEATURES] == [None, None, None]
    for name in FEATURES:
        assert columns[name]["statuses"] == ["PRESENT", "PRESENT", "NOT_FOUND"], name
        stamps = columns[name]["event_timestamps"]
        assert _at(stamps[0]) == now - timedelta(hours=1)
        assert _at(stamps[1]) == now - timedelta(hours=72)
        assert _at(stamps[2]).year == 1970  # Feast's "no timestamp"
    assert feast_server.registry_path.is_file() and feast_server.registry_path.stat().st_size > 0


def test_the_incompatible_version_is_served_too(feast_server: FeastServer) -> None:
    reply = httpx.post(
        f"{feast_server.url}/get-online-features",
        json={"feature_service": "ranker_v13", "entities": {"user_id": [2]}, "full_feature_names": True},
        timeout=10.0,
    )
    assert reply.status_code == 200, reply.text
    columns = _columns(reply.json())
    assert columns["user_stats_v13__score"]["values"] == [21.0]
