"""Write the demo's feature source, ``data/users.parquet``, deterministically from ``now`` (UTC).

Usage: ``python generate.py [--now 2025-01-01T12:00:00+00:00] [--out DIR]`` (default: the current
UTC time, whole seconds; ``DIR`` defaults to this file's ``data/``), or ``write_users(path, now)``.

Rows (columns ``user_id`` int64, ``score`` float32, ``clicks`` int64, ``risk`` float32,
``event_timestamp`` and ``created``, both UTC; ``created`` equals ``event_timestamp``):

* users 1..50 except 7 and 8: three snapshots, 3 h, 2 h and 1 h before ``now``, with
  ``score = user * 10 + hours_ago``, ``clicks = user * 100 + hours_ago``, ``risk = user / 64``.
  Every value is exactly representable in float32. After ``feast materialize`` the online
  store holds the latest, 1 h old: user 1 reads score 11.0, clicks 101, risk 0.015625.
* user 7: one row only, 72 h (3 days) before ``now`` (score 142.0, clicks 772, risk 0.109375):
  stale, older than any max age a test uses and than the views' 1-day ttl.
* user 8: no rows at all.

What Feast 0.49 returns for them (``POST /get-online-features``, ``ranker_v12``, after
``FeastServer``'s ``feast materialize <now - 7 days> <now>``; checked by
tests/test_feast_server.py):

* user 1: every feature ``PRESENT``, event timestamp ``now - 1h``.
* user 7: every feature ``PRESENT`` with its 3-day-old values and event timestamp: the view's
  ttl bounds what ``materialize`` reads from the offline store only when the window does not
  (``materialize-incremental``); the online read does not check it (no ``OUTSIDE_MAX_AGE``).
  Judging staleness from the returned event timestamp is the reader's job.
* user 8: every feature ``NOT_FOUND``, values ``null``.
"""

from __future__ import annotations

import argparse
from datetime import UTC, datetime, timedelta
from pathlib import Path

USERS = range(1, 51)
STALE_USER = 7
MISSING_USER = 8
SNAPSHOT_HOURS_AGO = (3, 2, 1)
STALE_HOURS_AGO = 72
DATA = Path(__file__).resolve().parent / "data"


def score(user: int, hours_ago: int) -> float:
    return float(user * 10 + hours_ago)


def clicks(user: int, hours_ago: int) -> int:
    return user * 100 + hours_ago


def risk(user: int) -> float:
    return user / 64  # a multiple of 2**-6: exact in float32


def rows(now: datetime) -> list[dict[str, object]]:
    """The source's rows for ``now`` (an aware datetime), in user then time order."""
    if now.tzinfo is None:
        raise ValueError("now must be timezone-aware (UTC)")
    now = now.astimezone(UTC)
    out: list[dict[str, object]] = []
    for user in USERS:
        if user == MISSING_USER:
            continue
        hours = (STALE_HOURS_AGO,) if user == STALE_USER else SNAPSHOT_HOURS_AGO
        for hours_ago in hours:
            at = now - timedelta(hours=hours_ago)
            out.append({
                "user_id": user,
                "score": score(user, hours_ago),
                "clicks": clicks(user, hours_ago),
                "risk": risk(user),
                "event_timestamp": at,
                "created": at,
            })  # fmt: skip
    return out


def write_users(path: Path, now: datetime) -> Path:
    """Write ``rows(now)`` as parquet to ``path`` (its directory is created); returns ``path``."""
    import pandas as pd  # Feast's own dependency (the `features` extra)

    frame = pd.DataFrame(rows(now))
    frame = frame.astype({"user_id": "int64", "score": "float32", "clicks": "int64", "risk": "float32"})
    for column in ("event_timestamp", "created"):
        frame[column] = pd.to_datetime(frame[column], utc=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.to_parquet(path, index=False)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--now", help="ISO time with offset (default: now, UTC, whole seconds)")
    parser.add_argument("--out", type=Path, default=DATA, help="directory for users.parquet")
    args = parser.parse_args(argv)
    now = datetime.fromisoformat(args.now) if args.now else datetime.now(UTC).replace(microsecond=0)
    print(write_users(args.out / "users.parquet", now))


if __name__ == "__main__":
    main()
