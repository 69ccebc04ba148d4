"""The durable job store: operations and their items in an embedded SQLite database.

Owns persistence only: the schema, tenant-scoped reads (every read a caller can reach
filters by tenant, so another tenant's id is indistinguishable from a missing one), the
idempotent insert, claims with leases, the conditional updates that make an item's
completion (and its charge) happen once, and when anything stored next falls due (an idle
runner's wake-up time). What a status *means* and how an item moves
after a failure are ``gateway.core.jobs``'s decisions; the caller passes their results in.

Durability: the database is in WAL mode with ``synchronous=FULL``, so a commit returns only
after the WAL is fsynced; ``insert`` commits before it returns, and the service replies to
Submit only after that. The state directory is created 0700 and the database (and the WAL
and shared-memory files SQLite derives from it, which take its mode) 0600: stored requests
and results are tenant data. One gateway process owns a state directory at a time (an
exclusive ``flock`` on ``jobs.lock``); at open, items a previous process was running are
released to the queue as lost leases (counted as an attempt: an item that kills its
runner cannot loop forever).

A batch's declared feature snapshot (``feature_snapshot``: as-of time, source, feature
service, definition version; JSON) is a column of ``operations``, added when the store opens a
database from before it (SQLite and PostgreSQL), and goes into the sealed manifest.

The methods are synchronous and serialised by a lock; the runtime calls them through
``asyncio.to_thread``.
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from enum import Enum
from pathlib import Path
from typing import Any

from gateway.config import JobsConfig
from gateway.core.jobs import (
    TERMINAL,
    AttemptResult,
    Counts,
    ItemStatus,
    JobLimits,
    Kind,
    OpStatus,
    operation_status,
    results_expire_at,
)

DB_NAME = "jobs.sqlite3"
LOCK_NAME = "jobs.lock"
EXPIRED_ERROR = "expired: the operation's complete-by time passed before this item ran"
LEASE_LOST_ERROR = "lease lost: the gateway running it stopped"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS operations (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  id TEXT NOT NULL UNIQUE,
  tenant TEXT NOT NULL,
  idempotency_key TEXT,
  request_hash TEXT NOT NULL,
  input_sha256 TEXT NOT NULL,
  kind TEXT NOT NULL,
  request_class TEXT NOT NULL,
  model TEXT NOT NULL,
  model_version TEXT NOT NULL DEFAULT '',
  status TEXT NOT NULL,
  cancel_requested INTEGER NOT NULL DEFAULT 0,
  expired INTEGER NOT NULL DEFAULT 0,
  created_at REAL NOT NULL,
  started_at REAL NOT NULL DEFAULT 0,
  finished_at REAL NOT NULL DEFAULT 0,
  complete_by REAL NOT NULL,
  results_expire_at REAL NOT NULL DEFAULT 0,
  results_expired INTEGER NOT NULL DEFAULT 0,
  error TEXT NOT NULL DEFAULT '',
  output_version INTEGER NOT NULL DEFAULT 0,
  manifest TEXT,
  feature_snapshot TEXT,
  UNIQUE (tenant, idempotency_key)
);
CREATE INDEX IF NOT EXISTS operations_tenant ON operations (tenant, seq);
CREATE TABLE IF NOT EXISTS items (
  op_seq INTEGER NOT NULL REFERENCES operations (seq),
  idx INTEGER NOT NULL,
  custom_id TEXT NOT NULL,
  request BLOB,
  status TEXT NOT NULL,
  attempts INTEGER NOT NULL DEFAULT 0,
  next_attempt_at REAL NOT NULL DEFAULT 0,
  claim TEXT,
  lease_until REAL NOT NULL DEFAULT 0,
  response BLOB,
  error TEXT NOT NULL DEFAULT '',
  charged_ms REAL NOT NULL DEFAULT 0,
  charges INTEGER NOT NULL DEFAULT 0,
  provenance TEXT,
  started_at REAL NOT NULL DEFAULT 0,
  finished_at REAL NOT NULL DEFAULT 0,
  PRIMARY KEY (op_seq, idx)
);
CREATE INDEX IF NOT EXISTS items_ready ON items (status, next_attempt_at);
"""


@dataclass(frozen=True, slots=True)
class NewOperation:
    id: str
    tenant: str
    idempotency_key: str | None
    request_hash: str  # what idempotency compares: the input, model and class
    input_sha256: str  # the input's own hash: the request's bytes, or the JSONL snapshot's
    kind: Kind
    request_class: str
    model: str
    model_version: str
    created_at: float
    complete_by: float
    # A batch's declared feature snapshot: as_of (RFC 3339), source, feature_service,
    # definition_version (``gateway.jobs.service``); None: online features.
    feature_snapshot: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Operation:
    seq: int
    id: str
    tenant: str
    idempotency_key: str | None
    request_hash: str
    input_sha256: str
    kind: Kind
    request_class: str
    model: str
    model_version: str
    status: OpStatus
    cancel_requested: bool
    expired: bool
    created_at: float
    started_at: float
    finished_at: float
    complete_by: float
    results_expire_at: float
    results_expired: bool
    error: str
    output_version: int
    manifest: dict[str, Any] | None
    counts: Counts
    charged_ms: float
    feature_snapshot: dict[str, Any] | None = None

    @property
    def done(self) -> bool:
        return self.status in TERMINAL


@dataclass(frozen=True, slots=True)
class Item:
    op_seq: int
    idx: int
    custom_id: str
    status: ItemStatus
    attempts: int
    response: bytes | None
    error: str
    charged_ms: float
    charges: int
    provenance: dict[str, str] | None


@dataclass(frozen=True, slots=True)
class Claimed:
    """An item claimed for one attempt: ``claim`` guards every update of this attempt."""

    op_id: str
    op_seq: int
    idx: int
    claim: str
    tenant: str
    model: str
    request_class: str
    kind: Kind
    request: bytes
    attempts: int
    feature_as_of: float | None = None  # epoch seconds: the item reads its features as of then


@dataclass(frozen=True, slots=True)
class Due:
    """When the store next has something to do (``JobStore.next_due``), in wall seconds."""

    ready_at: float | None  # a queued item becomes ready to claim
    housekeeping_at: float | None  # a lease runs out, an operation expires or its results go


class StateDirectoryBusy(OSError):
    """Another gateway process holds this state directory."""


class JobStore:
    """The store's operations over one connection (``SqliteJobStore``, ``PostgresJobStore``).
    SQL is written once with ``?`` placeholders; ``_x`` adapts it to the connection."""

    postgres = False
    claim_lock = ""  # PostgreSQL: a claimed row is locked, and rows others hold are skipped

    def __init__(self, db: Any, limits: JobLimits) -> None:
        self.limits = limits
        self._db = db
        self._mutex = threading.Lock()

    def close(self) -> None:
        with self._mutex:
            self._db.close()

    def _x(self, db: Any, sql: str, args: Sequence[Any] = ()) -> Any:
        if self.postgres:
            sql = sql.replace("?", "%s")
        return db.execute(sql, tuple(str(a) if isinstance(a, Enum) else a for a in args))

    def _xm(self, db: Any, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        if self.postgres:
            sql = sql.replace("?", "%s")
        cursor = db.cursor()
        cursor.executemany(sql, [tuple(str(a) if isinstance(a, Enum) else a for a in row) for row in rows])

    @contextmanager
    def _tx(self) -> Iterator[Any]:
        """One transaction; committed (and, both stores, durable on disk) when the block ends."""
        with self._mutex:
            if self.postgres:
                with self._db.transaction():
                    yield self._db
                return
            self._x(self._db, "BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._x(self._db, "ROLLBACK")
                raise
            self._x(self._db, "COMMIT")

    @contextmanager
    def _read(self) -> Iterator[Any]:
        with self._mutex:
            yield self._db

    # ------------------------------------------------------------------ operations

    def _counts(self, db: Any, seq: int) -> tuple[Counts, float]:
        by_status: dict[str, int] = {}
        charged = 0.0
        for status, n, ms in self._x(
            db, "SELECT status, COUNT(*), SUM(charged_ms) FROM items WHERE op_seq = ? GROUP BY status", (seq,)
        ):
            by_status[status] = n
            charged += ms or 0.0
        return (
            Counts(
                total=sum(by_status.values()),
                completed=by_status.get(ItemStatus.SUCCEEDED, 0),
                failed=by_status.get(ItemStatus.FAILED, 0),
                queued=by_status.get(ItemStatus.QUEUED, 0),
                running=by_status.get(ItemStatus.RUNNING, 0),
                cancelled=by_status.get(ItemStatus.CANCELLED, 0),
            ),
            charged,
        )

    _OP_COLUMNS = (
        "seq, id, tenant, idempotency_key, request_hash, input_sha256, kind, request_class, model, "
        "model_version, "
        "status, cancel_requested, expired, created_at, started_at, finished_at, complete_by, "
        "results_expire_at, results_expired, error, output_version, manifest, feature_snapshot"
    )

    def _operation(self, db: Any, row: tuple[Any, ...]) -> Operation:
        counts, charged = self._counts(db, row[0])
        return Operation(
            seq=row[0],
            id=row[1],
            tenant=row[2],
            idempotency_key=row[3],
            request_hash=row[4],
            input_sha256=row[5],
            kind=Kind(row[6]),
            request_class=row[7],
            model=row[8],
            model_version=row[9],
            status=OpStatus(row[10]),
            cancel_requested=bool(row[11]),
            expired=bool(row[12]),
            created_at=row[13],
            started_at=row[14],
            finished_at=row[15],
            complete_by=row[16],
            results_expire_at=row[17],
            results_expired=bool(row[18]),
            error=row[19],
            output_version=row[20],
            manifest=json.loads(row[21]) if row[21] else None,
            counts=counts,
            charged_ms=charged,
            feature_snapshot=json.loads(row[22]) if row[22] else None,
        )

    def _one(self, db: Any, where: str, args: tuple[Any, ...]) -> Operation | None:
        row = self._x(db, f"SELECT {self._OP_COLUMNS} FROM operations WHERE {where}", args).fetchone()
        return self._operation(db, row) if row else None

    def get(self, tenant: str, op_id: str) -> Operation | None:
        """The tenant's operation ``op_id``; None when missing *or another tenant's*."""
        with self._read() as db:
            return self._one(db, "id = ? AND tenant = ?", (op_id, tenant))

    def by_key(self, tenant: str, key: str) -> Operation | None:
        with self._read() as db:
            return self._one(db, "tenant = ? AND idempotency_key = ?", (tenant, key))

    def by_seq(self, seq: int) -> Operation | None:
        with self._read() as db:
            return self._one(db, "seq = ?", (seq,))

    def unfinished_items(self, tenant: str) -> int:
        with self._read() as db:
            row = self._x(
                db,
                "SELECT COUNT(*) FROM items JOIN operations ON operations.seq = items.op_seq "
                "WHERE operations.tenant = ? AND items.status IN (?, ?)",
                (tenant, ItemStatus.QUEUED, ItemStatus.RUNNING),
            ).fetchone()
            return int(row[0])

    def insert(self, new: NewOperation, items: list[tuple[str, bytes]]) -> tuple[Operation, bool]:
        """Store the operation and its items and commit (fsync) before returning. With an
        idempotency key already used by this tenant: the stored operation, not inserted
        (``False``); the caller compares request hashes."""
        try:
            return self._insert(new, items)
        except Exception as error:  # another replica inserted the same key first (PostgreSQL)
            if new.idempotency_key is None or "IntegrityError" not in {
                c.__name__ for c in type(error).__mro__
            }:
                raise
            found = self.by_key(new.tenant, new.idempotency_key)
            if found is None:
                raise
            return found, False

    def _insert(self, new: NewOperation, items: list[tuple[str, bytes]]) -> tuple[Operation, bool]:
        with self._tx() as db:
            if new.idempotency_key is not None:
                found = self._one(db, "tenant = ? AND idempotency_key = ?", (new.tenant, new.idempotency_key))
                if found is not None:
                    return found, False
            cursor = self._x(
                db,
                "INSERT INTO operations (id, tenant, idempotency_key, request_hash, input_sha256, kind, "
                "request_class, model, model_version, status, created_at, complete_by, feature_snapshot) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?) RETURNING seq",
                (
                    new.id,
                    new.tenant,
                    new.idempotency_key,
                    new.request_hash,
                    new.input_sha256,
                    new.kind,
                    new.request_class,
                    new.model,
                    new.model_version,
                    OpStatus.QUEUED,
                    new.created_at,
                    new.complete_by,
                    json.dumps(new.feature_snapshot, sort_keys=True) if new.feature_snapshot else None,
                ),
            )
            seq = int(cursor.fetchone()[0])
            self._xm(
                db,
                "INSERT INTO items (op_seq, idx, custom_id, request, status) VALUES (?,?,?,?,?)",
                ((seq, i, custom_id, blob, ItemStatus.QUEUED) for i, (custom_id, blob) in enumerate(items)),
            )
            created = self._one(db, "seq = ?", (seq,))
            assert created is not None
            return created, True

    def page(
        self, tenant: str, *, status: str, kind: str, before_seq: int | None, limit: int
    ) -> list[Operation]:
        """The tenant's operations, newest first, after the page token's ``before_seq``."""
        where, args = ["tenant = ?"], [tenant]
        if status:
            where.append("status = ?")
            args.append(status)
        if kind:
            where.append("kind = ?")
            args.append(kind)
        if before_seq is not None:
            where.append("seq < ?")
            args.append(str(before_seq))
        with self._read() as db:
            rows = self._x(
                db,
                f"SELECT {self._OP_COLUMNS} FROM operations WHERE {' AND '.join(where)} "
                "ORDER BY seq DESC LIMIT ?",
                (*args, limit),
            ).fetchall()
            return [self._operation(db, row) for row in rows]

    def _lock_items(self, db: Any, seq: int) -> None:
        """PostgreSQL: lock an operation's items before its row. Every transaction that touches
        both takes items first (a claim, a completion, a reclaim), so none waits in a cycle."""
        if self.postgres:
            self._x(db, "SELECT idx FROM items WHERE op_seq = ? ORDER BY idx FOR UPDATE", (seq,))

    def request_cancel(self, tenant: str, op_id: str, *, now: float) -> tuple[Operation | None, list[int]]:
        """Mark the tenant's operation cancelled: queued items are cancelled at once; the
        running ones' indexes are returned for the runner to cancel. A finished operation
        is returned unchanged."""
        with self._tx() as db:
            op = self._one(db, "id = ? AND tenant = ?", (op_id, tenant))
            if op is None or op.done:
                return op, []
            self._lock_items(db, op.seq)
            self._x(db, "UPDATE operations SET cancel_requested = 1 WHERE seq = ?", (op.seq,))
            self._x(
                db,
                "UPDATE items SET status = ?, finished_at = ?, error = 'cancelled', request = NULL "
                "WHERE op_seq = ? AND status = ?",
                (ItemStatus.CANCELLED, now, op.seq, ItemStatus.QUEUED),
            )
            running = [
                r[0]
                for r in self._x(
                    db, "SELECT idx FROM items WHERE op_seq = ? AND status = ?", (op.seq, ItemStatus.RUNNING)
                )
            ]
            self._refresh(db, op.seq, now=now)
            return self._one(db, "seq = ?", (op.seq,)), running

    # ------------------------------------------------------------------ the runner's side

    def ready_models(self, *, now: float) -> list[tuple[str, str]]:
        """(tenant, model) pairs with an item ready to run now."""
        with self._read() as db:
            rows = self._x(
                db,
                "SELECT DISTINCT o.tenant, o.model FROM items i JOIN operations o ON o.seq = i.op_seq "
                "WHERE (i.status = ? AND i.next_attempt_at <= ?) OR (i.status = ? AND i.lease_until < ?) "
                "ORDER BY o.tenant, o.model",
                (ItemStatus.QUEUED, now, ItemStatus.RUNNING, now),
            ).fetchall()
            return [(r[0], r[1]) for r in rows]

    def next_due(self) -> Due:
        """When anything stored next becomes due (wall seconds; None: nothing will): the
        earliest queued item's ``next_attempt_at`` (a backoff or deferral ending), and the
        earliest moment housekeeping has work: a running item's lease running out (a lost
        replica's), an unfinished operation's complete-by, a finished one's retention. An idle
        runner sleeps until then (``gateway.jobs.runner``)."""
        with self._read() as db:
            row = self._x(
                db,
                "SELECT (SELECT MIN(next_attempt_at) FROM items WHERE status = ?), "
                "(SELECT MIN(lease_until) FROM items WHERE status = ?), "
                "(SELECT MIN(complete_by) FROM operations WHERE expired = 0 AND status NOT IN (?, ?, ?, ?)), "
                "(SELECT MIN(results_expire_at) FROM operations "
                "WHERE results_expired = 0 AND finished_at > 0)",
                (ItemStatus.QUEUED, ItemStatus.RUNNING, *TERMINAL),
            ).fetchone()
        housekeeping = [t for t in row[1:] if t is not None]
        return Due(ready_at=row[0], housekeeping_at=min(housekeeping) if housekeeping else None)

    def reclaim_lost(self, *, now: float) -> int:
        """Running items whose lease ran out go back to the queue, the lost attempt counted;
        past the attempt bound they fail. Returns how many were reclaimed."""
        with self._tx() as db:
            rows = self._x(
                db,
                "SELECT op_seq, idx, attempts FROM items WHERE status = ? AND lease_until < ?"
                + (" FOR UPDATE SKIP LOCKED" if self.postgres else ""),
                (ItemStatus.RUNNING, now),
            ).fetchall()
            touched = set()
            for seq, idx, attempts in rows:
                counted = attempts + 1
                if counted >= self.limits.max_attempts:
                    self._x(
                        db,
                        "UPDATE items SET status = ?, attempts = ?, claim = NULL, error = ?, finished_at = ? "
                        "WHERE op_seq = ? AND idx = ?",
                        (ItemStatus.FAILED, counted, LEASE_LOST_ERROR, now, seq, idx),
                    )
                else:
                    self._x(
                        db,
                        "UPDATE items SET status = ?, attempts = ?, claim = NULL, next_attempt_at = ? "
                        "WHERE op_seq = ? AND idx = ?",
                        (ItemStatus.QUEUED, counted, now, seq, idx),
                    )
                touched.add(seq)
            for seq in touched:
                self._refresh(db, seq, now=now)
            return len(rows)

    def claim(self, *, tenant: str, model: str, claim: str, now: float, lease_until: float) -> Claimed | None:
        """Take the next ready item of (tenant, model) for one attempt, oldest first."""
        with self._tx() as db:
            row = self._x(
                db,
                "SELECT i.op_seq, i.idx, o.id, o.request_class, o.kind, i.request, i.attempts, "
                "o.feature_snapshot FROM items i JOIN operations o ON o.seq = i.op_seq "
                "WHERE o.tenant = ? AND o.model = ? AND i.status = ? AND i.next_attempt_at <= ? "
                "AND o.cancel_requested = 0 ORDER BY i.next_attempt_at, i.op_seq, i.idx LIMIT 1"
                + self.claim_lock,
                (tenant, model, ItemStatus.QUEUED, now),
            ).fetchone()
            if row is None:
                return None
            seq, idx, op_id, request_class, kind, request, attempts, snapshot = row
            self._x(
                db,
                "UPDATE items SET status = ?, claim = ?, lease_until = ?, started_at = ? "
                "WHERE op_seq = ? AND idx = ?",
                (ItemStatus.RUNNING, claim, lease_until, now, seq, idx),
            )
            self._x(db, "UPDATE operations SET started_at = ? WHERE seq = ? AND started_at = 0", (now, seq))
            self._refresh(db, seq, now=now)
            return Claimed(
                op_id,
                seq,
                idx,
                claim,
                tenant,
                model,
                request_class,
                Kind(kind),
                request,
                attempts,
                feature_as_of=_as_of(snapshot),
            )

    def renew(self, claims: list[str], *, lease_until: float) -> None:
        if not claims:
            return
        with self._tx() as db:
            self._xm(
                db,
                "UPDATE items SET lease_until = ? WHERE claim = ? AND status = ?",
                ((lease_until, c, ItemStatus.RUNNING) for c in claims),
            )

    def complete(
        self,
        item: Claimed,
        *,
        response: bytes,
        provenance: dict[str, str],
        charged_ms: float,
        now: float,
    ) -> bool:
        """Record a validated output and its charge, once: only the attempt still holding its
        claim writes (a reclaimed or cancelled attempt's late answer is dropped)."""
        with self._tx() as db:
            cursor = self._x(
                db,
                "UPDATE items SET status = ?, response = ?, provenance = ?, charged_ms = ?, "
                "charges = charges + 1, finished_at = ?, claim = NULL, error = '', request = NULL "
                "WHERE op_seq = ? AND idx = ? AND claim = ? AND status = ?",
                (
                    ItemStatus.SUCCEEDED,
                    response,
                    json.dumps(provenance, sort_keys=True),
                    charged_ms,
                    now,
                    item.op_seq,
                    item.idx,
                    item.claim,
                    ItemStatus.RUNNING,
                ),
            )
            self._refresh(db, item.op_seq, now=now)
            return bool(cursor.rowcount == 1)

    def failed_attempt(self, item: Claimed, result: AttemptResult, *, error: str, now: float) -> bool:
        """Record an attempt that did not produce an output (``result`` from
        ``gateway.core.jobs.after_attempt``)."""
        with self._tx() as db:
            done = result.status is ItemStatus.FAILED
            cursor = self._x(
                db,
                "UPDATE items SET status = ?, attempts = ?, next_attempt_at = ?, claim = NULL, error = ?, "
                "finished_at = ?, request = CASE WHEN ? THEN NULL ELSE request END "
                "WHERE op_seq = ? AND idx = ? AND claim = ? AND status = ?",
                (
                    result.status,
                    result.attempts,
                    result.next_attempt_at,
                    error,
                    now if done else 0.0,
                    done,
                    item.op_seq,
                    item.idx,
                    item.claim,
                    ItemStatus.RUNNING,
                ),
            )
            self._refresh(db, item.op_seq, now=now)
            return bool(cursor.rowcount == 1)

    def release(self, item: Claimed, *, now: float) -> None:
        """Give a claimed item back to the queue, the attempt not counted (a clean stop)."""
        with self._tx() as db:
            self._x(
                db,
                "UPDATE items SET status = ?, claim = NULL, next_attempt_at = ? "
                "WHERE op_seq = ? AND idx = ? AND claim = ? AND status = ?",
                (ItemStatus.QUEUED, now, item.op_seq, item.idx, item.claim, ItemStatus.RUNNING),
            )
            self._refresh(db, item.op_seq, now=now)

    def cancelled_attempt(self, item: Claimed, *, now: float) -> None:
        """The runner stopped this attempt because its operation was cancelled."""
        with self._tx() as db:
            self._x(
                db,
                "UPDATE items SET status = ?, claim = NULL, error = 'cancelled', finished_at = ?, "
                "request = NULL "
                "WHERE op_seq = ? AND idx = ? AND claim = ?",
                (ItemStatus.CANCELLED, now, item.op_seq, item.idx, item.claim),
            )
            self._refresh(db, item.op_seq, now=now)

    def cancel_requested(self, seqs: list[int]) -> set[int]:
        """Which of these operations a caller has asked to cancel (a replica's check)."""
        if not seqs:
            return set()
        with self._read() as db:
            marks = ",".join("?" * len(seqs))
            return {
                r[0]
                for r in self._x(
                    db, f"SELECT seq FROM operations WHERE cancel_requested = 1 AND seq IN ({marks})", seqs
                )
            }

    def expire_due(self, *, now: float) -> list[str]:
        """Operations whose complete-by passed: their queued items fail as expired (running
        ones finish; then the operation is ``expired``). Returns their ids."""
        with self._tx() as db:
            rows = self._x(
                db,
                "SELECT seq, id FROM operations WHERE expired = 0 AND complete_by <= ? AND status NOT IN "
                "(?, ?, ?, ?)",
                (now, *TERMINAL),
            ).fetchall()
            for seq, _ in rows:
                self._lock_items(db, seq)
                self._x(db, "UPDATE operations SET expired = 1 WHERE seq = ?", (seq,))
                self._x(
                    db,
                    "UPDATE items SET status = ?, error = ?, finished_at = ?, request = NULL "
                    "WHERE op_seq = ? AND status = ?",
                    (ItemStatus.FAILED, EXPIRED_ERROR, now, seq, ItemStatus.QUEUED),
                )
                self._refresh(db, seq, now=now)
            return [r[1] for r in rows]

    def purge_due(self, *, now: float) -> list[str]:
        """Finished operations past their retention: results (and any stored request) are
        deleted; the operation's status and counts remain, marked ``results_expired``."""
        with self._tx() as db:
            rows = self._x(
                db,
                "SELECT seq, id FROM operations WHERE results_expired = 0 AND finished_at > 0 "
                "AND results_expire_at <= ?",
                (now,),
            ).fetchall()
            for seq, _ in rows:
                self._x(
                    db,
                    "UPDATE items SET response = NULL, request = NULL, provenance = NULL WHERE op_seq = ?",
                    (seq,),
                )
                self._x(db, "UPDATE operations SET results_expired = 1 WHERE seq = ?", (seq,))
            return [r[1] for r in rows]

    def items(self, seq: int, *, after_idx: int, limit: int) -> list[Item]:
        with self._read() as db:
            rows = self._x(
                db,
                "SELECT op_seq, idx, custom_id, status, attempts, response, error, charged_ms, charges, "
                "provenance FROM items WHERE op_seq = ? AND idx > ? ORDER BY idx LIMIT ?",
                (seq, after_idx, limit),
            ).fetchall()
        return [
            Item(
                op_seq=r[0],
                idx=r[1],
                custom_id=r[2],
                status=ItemStatus(r[3]),
                attempts=r[4],
                response=r[5],
                error=r[6],
                charged_ms=r[7],
                charges=r[8],
                provenance=json.loads(r[9]) if r[9] else None,
            )
            for r in rows
        ]

    # ------------------------------------------------------------------ status and manifest

    def _refresh(self, db: Any, seq: int, *, now: float) -> None:
        """Recompute an operation's status from its items; seal it (finish time, retention,
        manifest, output version 1) the first time it is done. On PostgreSQL the operation's
        row is locked first: replicas finishing its items at once recompute it one at a time."""
        if self.postgres:
            self._x(db, "SELECT seq FROM operations WHERE seq = ? FOR UPDATE", (seq,))
        op = self._one(db, "seq = ?", (seq,))
        assert op is not None
        status = operation_status(
            op.kind,
            op.counts,
            cancel_requested=op.cancel_requested,
            expired=op.expired,
        )
        if status is op.status:
            return
        if status not in TERMINAL:
            self._x(db, "UPDATE operations SET status = ? WHERE seq = ?", (status, seq))
            return
        error = ""
        if status is OpStatus.FAILED:
            row = self._x(
                db,
                "SELECT error FROM items WHERE op_seq = ? AND status = ? LIMIT 1",
                (seq, ItemStatus.FAILED),
            ).fetchone()
            error = row[0] if row else ""
        elif status is OpStatus.EXPIRED:
            error = EXPIRED_ERROR
        policies = sorted(
            {
                json.loads(r[0]).get("orchid.policy_version", "")
                for r in self._x(
                    db, "SELECT provenance FROM items WHERE op_seq = ? AND provenance IS NOT NULL", (seq,)
                )
            }
            - {""}
        )
        manifest = {
            "id": op.id,
            "kind": str(op.kind),
            "status": str(status),
            "input_sha256": op.input_sha256,
            "model": op.model,
            "model_version": op.model_version,
            "request_class": op.request_class,
            "policy_version": ",".join(policies),
            "total": op.counts.total,
            "completed": op.counts.completed,
            "failed": op.counts.failed,
            "cancelled": op.counts.cancelled,
            "created_at": op.created_at,
            "started_at": op.started_at,
            "finished_at": now,
            "charged_accelerator_ms": round(op.charged_ms, 3),
            "output_version": 1,
        }
        if op.feature_snapshot:  # the declared snapshot: time, source, service, definition version
            manifest["feature_snapshot"] = op.feature_snapshot
        self._x(
            db,
            "UPDATE operations SET status = ?, finished_at = ?, results_expire_at = ?, error = ?, "
            "manifest = ?, output_version = 1 WHERE seq = ?",
            (
                status,
                now,
                results_expire_at(now, self.limits),
                error,
                json.dumps(manifest, sort_keys=True),
                seq,
            ),
        )


class SqliteJobStore(JobStore):
    """The embedded default: ``jobs.sqlite3`` in the state directory, one gateway at a time."""

    def __init__(self, state_dir: Path, limits: JobLimits) -> None:
        self.state_dir = state_dir
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(state_dir, 0o700)
        self._lock_fd = os.open(state_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._lock_fd, 32, 0).decode("ascii", "replace").strip()
            os.close(self._lock_fd)
            raise StateDirectoryBusy(
                f"job state directory {state_dir} is in use by another gateway"
                + (f" (pid {holder})" if holder.isdigit() else "")
                + ": one gateway per directory (stop it, or set another jobs.state_dir)"
            ) from None
        os.ftruncate(self._lock_fd, 0)  # the holder's pid, for the message above
        os.pwrite(self._lock_fd, f"{os.getpid()}\n".encode(), 0)
        self.path = state_dir / DB_NAME
        for suffix in ("", "-wal", "-shm"):  # SQLite derives the WAL's and shm's mode from the db's
            os.close(os.open(f"{self.path}{suffix}", os.O_RDWR | os.O_CREAT, 0o600))
            os.chmod(f"{self.path}{suffix}", 0o600)
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        super().__init__(db, limits)
        self._x(db, "PRAGMA journal_mode=WAL")
        self._x(db, "PRAGMA synchronous=FULL")
        self._x(db, "PRAGMA foreign_keys=ON")
        db.executescript(_SCHEMA)
        columns = {row[1] for row in self._x(db, "PRAGMA table_info(operations)")}
        if "feature_snapshot" not in columns:  # a database from before feature snapshots
            self._x(db, "ALTER TABLE operations ADD COLUMN feature_snapshot TEXT")
        with self._tx() as tx:  # one process per directory: a previous one's leases are lost
            self._x(tx, "UPDATE items SET lease_until = 0 WHERE status = ?", (ItemStatus.RUNNING,))

    def close(self) -> None:
        super().close()
        os.close(self._lock_fd)


class PostgresJobStore(JobStore):
    """Jobs shared by several replicas (``jobs.store: postgres``): claims take the next ready
    item with ``SELECT ... FOR UPDATE SKIP LOCKED`` (two replicas never claim one item) and
    hold it by a lease each replica renews; a dead replica's items go back to the queue when
    their lease runs out. Commits are durable with PostgreSQL's default
    ``synchronous_commit = on``."""

    postgres = True
    claim_lock = " FOR UPDATE OF i SKIP LOCKED"

    def __init__(self, dsn: str, limits: JobLimits) -> None:
        import psycopg

        db = psycopg.connect(dsn, autocommit=True)
        super().__init__(db, limits)
        with self._tx() as tx:
            self._x(tx, "SELECT pg_advisory_xact_lock(7215)")  # one replica creates the schema
            if self._x(tx, "SELECT to_regclass('items')").fetchone()[0] is not None:
                # DDL on tables in use (even IF NOT EXISTS) locks them: only a missing column
                # (a database from before feature snapshots) is added, once.
                if not self._x(
                    tx,
                    "SELECT 1 FROM information_schema.columns WHERE table_schema = current_schema() "
                    "AND table_name = 'operations' AND column_name = 'feature_snapshot'",
                ).fetchone():
                    self._x(tx, "ALTER TABLE operations ADD COLUMN IF NOT EXISTS feature_snapshot TEXT")
                return
            for statement in (
                _SCHEMA.replace("INTEGER PRIMARY KEY AUTOINCREMENT", "BIGSERIAL PRIMARY KEY")
                .replace(" BLOB", " BYTEA")
                .replace(" REAL ", " DOUBLE PRECISION ")
                .split(";")
            ):
                if statement.strip():
                    self._x(tx, statement)


def _as_of(snapshot: str | None) -> float | None:
    """The epoch seconds of a stored feature snapshot's ``as_of``; None without one."""
    if not snapshot:
        return None
    return datetime.fromisoformat(json.loads(snapshot)["as_of"]).timestamp()


def open_store(config: JobsConfig, limits: JobLimits) -> JobStore:
    """The store ``jobs.store`` names."""
    if config.store == "postgres":
        assert config.postgres_dsn is not None  # the config's validation requires it
        return PostgresJobStore(config.postgres_dsn, limits)
    assert config.state_dir is not None
    return SqliteJobStore(config.state_dir, limits)
