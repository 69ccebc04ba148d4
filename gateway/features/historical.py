"""Point-in-time feature reads for batch jobs that declare a feature snapshot (issue 29).

A batch submitted with ``feature_snapshot`` T reads every item's features *as of T*, not as
they are now: "a million-item job that finishes quickly with the wrong feature snapshot is not
goodput". The job runner marks each item of such a batch with the gateway-owned request
parameter ``orchid.feature_as_of`` (epoch seconds; an online caller sending it is refused), and
``Features.fetch`` then reads here instead of the online store:

* through the Feast SDK's historical retrieval on the source's feature repository
  (``feature_sources.<name>.repo``): ``FeatureStore(repo_path).get_historical_features`` with
  an entity frame of the request's entities at ``event_timestamp`` = T and the contract's
  feature service, so the definitions are the ones the online path checks (the registry's
  ``definition_version`` gate still runs first);
* in a worker thread (``asyncio.to_thread``): Feast is imported there, lazily and once per
  process (it costs seconds and pandas; a gateway that never runs a snapshot batch never
  imports it), and one ``FeatureStore`` per repository is kept;
* turned into the ``(feature_names, columns)`` shape ``core.upstream.judge`` takes, and judged
  with max ages measured from T (``wall=T``): a batch as of T uses values that were fresh at T.

Event times. Feast 0.49's offline stores answer the value as of T but not its event time (the
point-in-time join drops the timestamp columns). What Feast guarantees is the view's ``ttl``:
a value is returned only if its row's event time lies in ``[T - ttl, T]`` (else null). Each
value's event time is therefore taken to be T itself, its age at T bounded by the view's ttl:
a contract's ``max_age_s`` is enforced here only as far as the view's ttl is at most that age
(the example's views: 1 day). A value absent as of T (no row in the window, or no row at all;
Feast then drops or nulls the entity's row) is ``NOT_FOUND`` and follows the contract's
missing policy, exactly as an online read that found nothing. Provenance reads
``orchid.feature_snapshot: <definition version>@<T>``: the as-of time, not the oldest event.

Cache: per (tenant, authorization scope, service@version, registry generation, T, entities),
a small in-memory LRU with no time bound (values as of a past T do not change unless the
offline data is rewritten: a backfill under a running job is not seen until the entry leaves
the LRU), and concurrent reads of one key share a single retrieval (a batch's items often
share entities).

A source without ``repo``, or a process without Feast, fails the item with
FAILED_PRECONDITION ``features.snapshot_unavailable`` (and the submit of such a batch is
refused up front: ``gateway.jobs.service``).
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
import threading
from collections import OrderedDict
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tritonclient.grpc import service_pb2

from gateway.core import upstream
from gateway.core.errors import DeadlineInfeasible, FailedPrecondition, InvalidArgument, Unavailable
from gateway.core.upstream import FeatureContract, FeatureSnapshot, FeatureValues

RULE_SNAPSHOT_UNAVAILABLE = "features.snapshot_unavailable"
AS_OF_PARAMETER = "orchid.feature_as_of"  # gateway-owned: only the job runner sets it
NOT_FOUND = "NOT_FOUND"  # Feast's status for a value it has none of
CACHE_ENTRIES = 1024
_ROW = "__orchid_row"  # the entity frame's row number: Feast reorders (and may drop) rows
_TIMESTAMP = "event_timestamp"

# --------------------------------------------------------------------------- the snapshot time


def parse_snapshot(text: str, *, now: float) -> float:
    """An RFC 3339 / ISO 8601 time with a UTC offset (``2026-01-02T03:04:05Z``) as epoch
    seconds; INVALID_ARGUMENT when malformed, without an offset, or after ``now``."""
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise InvalidArgument(
            f"feature_snapshot {text[:64]!r} is not an RFC 3339 time (e.g. 2026-01-02T03:04:05Z)"
        ) from None
    if moment.tzinfo is None or moment.utcoffset() is None:
        raise InvalidArgument(f"feature_snapshot {text[:64]!r} has no UTC offset: write it with Z or +HH:MM")
    epoch = moment.timestamp()
    if not math.isfinite(epoch) or epoch > now:
        raise InvalidArgument(
            f"feature_snapshot {iso(epoch)} is in the future: a snapshot is a time the data existed"
        )
    return epoch


def iso(epoch: float) -> str:
    """Epoch seconds as RFC 3339 UTC (``...Z``)."""
    return datetime.fromtimestamp(epoch, UTC).isoformat().replace("+00:00", "Z")


def feast_installed() -> bool:
    """Whether the Feast SDK can be imported (without importing it)."""
    return importlib.util.find_spec("feast") is not None


def read_as_of(parameters: Mapping[str, Any]) -> float | None:
    """The ``orchid.feature_as_of`` a request carries (epoch seconds), None without one."""
    if AS_OF_PARAMETER not in parameters:
        return None
    param = parameters[AS_OF_PARAMETER]
    kind = param.WhichOneof("parameter_choice")
    value = float(getattr(param, kind)) if kind in ("double_param", "int64_param") else math.nan
    if not math.isfinite(value):
        raise InvalidArgument(f"parameter {AS_OF_PARAMETER} must be epoch seconds")
    return value


def without_parameter(request: service_pb2.ModelInferRequest, name: str) -> service_pb2.ModelInferRequest:
    """A copy of ``request`` without parameter ``name`` (the caller's request is left as is:
    a late re-admission or a canary's retry reads it again)."""
    out = service_pb2.ModelInferRequest()
    out.CopyFrom(request)
    del out.parameters[name]
    return out


class SnapshotUnavailable(Exception):
    """Historical retrieval cannot run here (no repository, no Feast, no such service)."""


# --------------------------------------------------------------------------- the reader

CacheKey = tuple[str, str, str, str, float, tuple[str, ...]]


class HistoricalSource:
    """One feature source's point-in-time reads (its ``repo``; None: not configured)."""

    def __init__(self, name: str, repo: Path | None, *, cache_entries: int = CACHE_ENTRIES) -> None:
        self.name = name
        self.repo = repo
        self.cache_entries = cache_entries
        self._cache: OrderedDict[CacheKey, FeatureValues] = OrderedDict()
        self._inflight: dict[CacheKey, asyncio.Future[FeatureValues]] = {}
        self._store: Any = None
        self._store_lock = threading.Lock()
        self.reads = 0  # retrievals run (cache misses)
        self.hits = 0

    # ---------------------------------------------------------------- worker-thread side

    def _feature_store(self) -> Any:
        with self._store_lock:
            if self._store is None:
                if self.repo is None:
                    raise SnapshotUnavailable(
                        f"feature source {self.name!r} has no historical retrieval "
                        f"(feature_sources.{self.name}.repo is not set)"
                    )
                try:
                    # Lazily: seconds and pandas, only when a snapshot batch asks (no stubs needed).
                    feature_store = importlib.import_module("feast").FeatureStore
                except ImportError:
                    raise SnapshotUnavailable(
                        "the Feast SDK is not installed (the features extra) for historical reads"
                    ) from None
                try:
                    self._store = feature_store(repo_path=str(self.repo))
                except Exception as error:
                    raise SnapshotUnavailable(
                        f"feature repository {self.repo} cannot be opened: {type(error).__name__}: {error}"
                    ) from None
            return self._store

    def retrieve(
        self, service: str, entities: Mapping[str, list[int | str]], count: int, as_of: float
    ) -> tuple[list[str], list[tuple[list[object], list[str], list[float | None]]]]:
        """Blocking: the service's values as of ``as_of`` for ``count`` entities, in the
        request's order, as ``upstream.judge`` takes them (event times: ``as_of``, see the
        module's docstring)."""
        store = self._feature_store()
        pd: Any = importlib.import_module("pandas")  # Feast's own dependency: there with it

        try:
            feature_service = store.get_feature_service(service)
        except Exception as error:
            raise SnapshotUnavailable(
                f"feature service {service!r} is not in {self.repo}: {type(error).__name__}"
            ) from None
        moment = pd.Timestamp(as_of, unit="s", tz="UTC")
        frame = pd.DataFrame(
            {**{key: list(values) for key, values in entities.items()}, _TIMESTAMP: [moment] * count}
        )
        frame[_ROW] = range(count)
        job = store.get_historical_features(
            entity_df=frame, features=feature_service, full_feature_names=True
        )
        answer = job.to_df()
        names = [c for c in answer.columns if c not in frame.columns]
        # Feast drops an entity's row when none of its rows fall in the view's window: such a
        # row, like a null, is a value Feast has none of as of the snapshot.
        by_row = answer.drop_duplicates(subset=[_ROW], keep="last").set_index(_ROW).reindex(range(count))
        columns: list[tuple[list[object], list[str], list[float | None]]] = []
        for name in names:
            values: list[object] = []
            statuses: list[str] = []
            for value in by_row[name].tolist():
                if value is None or bool(pd.isna(value)):
                    values.append(None)
                    statuses.append(NOT_FOUND)
                else:
                    values.append(value.item() if hasattr(value, "item") else value)
                    statuses.append(upstream.PRESENT)
            columns.append((values, statuses, [as_of] * count))
        return names, columns

    # ---------------------------------------------------------------- the runtime's side

    async def fetch(
        self,
        contract: FeatureContract,
        entities: Mapping[str, list[int | str]],
        count: int,
        *,
        tenant: str,
        scope: str,
        generation: str,
        as_of: float,
        time_left_s: float,
    ) -> tuple[FeatureValues, FeatureSnapshot]:
        """The request's features as of ``as_of``, judged by the contract with ages measured
        from ``as_of``; a ``GatewayError`` when they cannot be had."""
        key: CacheKey = (
            tenant,
            scope,
            f"{contract.feature_service}@{contract.definition_version}",
            generation,
            as_of,
            tuple(f"{k}={','.join(map(str, v))}" for k, v in sorted(entities.items())),
        )
        found = self._cache.get(key)
        if found is not None:
            self._cache.move_to_end(key)
            self.hits += 1
            return found, self._snapshot(contract, found, as_of, cached=True)
        pending = self._inflight.get(key)
        if pending is None:
            pending = asyncio.get_running_loop().create_task(
                self._read(key, contract, entities, count, as_of)
            )
            self._inflight[key] = pending
            pending.add_done_callback(_retrieved)
        try:
            # Shielded: a request out of time leaves the shared read to the others (and the cache).
            values = await asyncio.wait_for(asyncio.shield(pending), max(0.0, time_left_s))
        except TimeoutError:
            raise DeadlineInfeasible(
                f"features as of {iso(as_of)}: the historical read did not finish in the "
                f"{max(0.0, time_left_s):.1f} s the item's deadline left",
                rule=upstream.RULE_NO_TIME,
            ) from None
        return values, self._snapshot(contract, values, as_of, cached=False)

    async def _read(
        self,
        key: CacheKey,
        contract: FeatureContract,
        entities: Mapping[str, list[int | str]],
        count: int,
        as_of: float,
    ) -> FeatureValues:
        try:
            try:
                names, columns = await asyncio.to_thread(
                    self.retrieve, contract.feature_service, entities, count, as_of
                )
            except SnapshotUnavailable as error:
                raise FailedPrecondition(
                    f"features as of {iso(as_of)}: {error}", rule=RULE_SNAPSHOT_UNAVAILABLE
                ) from None
            except Exception as error:  # the offline store failed: retried by the job's bounds
                raise Unavailable(
                    f"features as of {iso(as_of)}: historical retrieval failed: {type(error).__name__}: "
                    f"{str(error)[:200]}",
                    rule=upstream.RULE_SOURCE_FAILED,
                ) from None
            self.reads += 1
            judged = upstream.judge(contract, names, columns, entities=count, wall=as_of)
            if isinstance(judged, upstream.Refusal):
                raise FailedPrecondition(f"features as of {iso(as_of)}: {judged.message}", rule=judged.rule)
            if self.cache_entries > 0:
                self._cache[key] = judged
                while len(self._cache) > self.cache_entries:
                    self._cache.popitem(last=False)
            return judged
        finally:
            self._inflight.pop(key, None)

    @staticmethod
    def _snapshot(
        contract: FeatureContract, values: FeatureValues, as_of: float, *, cached: bool
    ) -> FeatureSnapshot:
        # The as-of time stands where the online path puts the oldest event: v12@<T>.
        return FeatureSnapshot(contract.definition_version, as_of, values.defaulted, cached)


def _retrieved(task: asyncio.Future[FeatureValues]) -> None:
    """A shared read whose every waiter gave up: its outcome is still collected."""
    if not task.cancelled():
        task.exception()


__all__ = [
    "AS_OF_PARAMETER",
    "RULE_SNAPSHOT_UNAVAILABLE",
    "HistoricalSource",
    "feast_installed",
    "iso",
    "parse_snapshot",
    "read_as_of",
    "without_parameter",
]
