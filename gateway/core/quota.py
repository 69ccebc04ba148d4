"""Quota ledgers: hierarchical token buckets, reserved at admission, settled on observed work.

Owns the tenants' quota state: how many accelerator-ms (and live-token-ms) each tenant may spend
in each request class, how much it has reserved and not yet settled, and the refusals that follow
(``quota.*`` rules). It is a pure decision core like h11's state machine: every method takes
``now`` (seconds, monotonic) from the caller; it must not read a clock, do I/O, await, or log.
Nothing here awaits, so callers on one event loop need no lock. It must not create state for
names that arrive with a request: every bucket is built from ``QuotaSettings`` at construction,
so memory is bounded by configuration, never by traffic.

Theory of operation
-------------------
Buckets. Each (tenant, request class) account is a token bucket of accelerator-ms: it refills at
``accelerator_ms_per_s`` up to ``burst_ms`` and is debited by admitted work. An optional second
bucket meters live-token-ms (sequence memory held over time), because the seed's point is that
request counts fail when one tenant sends long contexts: price compute *and* memory.

Hierarchy. A request class with a ``ClassShareConfig`` has a parent bucket for the whole class.
Every admission in the class debits the parent too, so the parent's level is the class's
*unused* capacity. Tenants either state their own rate or take ``weight`` of the class share
(the share left after explicit rates, split by weight). The parent never blocks a tenant's own
guarantee: an admission paid from the tenant's own bucket passes even when the parent is empty
(the parent then goes negative, which only stops borrowing).

Borrowing. When the tenant's bucket cannot pay, it may borrow from the class's idle capacity:
the request passes if the parent holds the whole demand, the tenant is not in debt, and the
tenant's *outstanding* borrowed accelerator-ms (admitted on borrowed tokens, not yet settled)
stay within ``borrow_fraction x burst_ms``. The tenant spends what it has first and borrows the
rest. Invariant: at any instant a tenant holds at most ``borrow_fraction x burst_ms`` of
capacity it did not earn, so when lenders return the class is over-committed by at most the sum
of those bounds. Under contention the parent holds no idle tokens, nobody borrows, and each
tenant converges to its own rate: shares follow the weights.

Reserve then settle. ``reserve`` debits the *predicted* demand before the request queues, so
concurrent admissions cannot all spend the same tokens. ``settle`` corrects with the *observed*
charge. The class pays the observed charge; the tenant's own bucket pays what exceeds the
borrowed part, so a refund returns the tenant's own part first, and an overcharge is debited
from the tenant's bucket and may drive it negative, which delays its next admission (chronic
underprediction is paid by the underpredicted tenant, not its neighbours).
``release`` refunds a request that never ran. Both are idempotent: a reservation closes at most
once, later calls return ``None``. ``outstanding()`` counts what is open, so a test or a gauge
can prove that reservations never leak. ``start`` marks a reservation as dispatched (queued ->
executing) so queued work can be limited separately from work in flight.

Tenants without a quota for a class
-----------------------------------
1. A configured (tenant, class) entry: its own buckets.
2. Otherwise, when the class has a share with a ``default`` entry: every unconfigured tenant of
   that class draws on one shared pool (account ``("*", class)``), like Kubernetes API priority
   and fairness's catch-all level. One pool per class keeps memory bounded by configuration.
   Refusal messages from the pool carry no numbers: they are other tenants' numbers too.
3. Otherwise: unmetered (never refused by quota; ``metered=False`` on the reservation and the
   view so the decision log can say it failed open). If the class has a share, unmetered work
   still debits the parent, so it shrinks the idle capacity others may borrow.
Authorization (which classes a tenant may use) is decided before quota, not here.

Refusals
--------
``ResourceExhausted`` (RESOURCE_EXHAUSTED, retryable) for rate and concurrency limits, with
``retry_after_ms`` computed from the binding limit (bucket refill, predicted drain), ceiled to
whole ms, never a constant. When several limits refuse, the one with the longest wait is
reported, so retrying at that time does not meet another of them immediately.
``PermissionDenied`` (PERMISSION_DENIED, not retryable) for length caps: a context or output
longer than the tenant's entitlement does not become acceptable by waiting (RESOURCE_EXHAUSTED
would invite retry loops), and the shape itself is valid -- another tenant may send it -- so it is
not INVALID_ARGUMENT.

Limits and their reasons
------------------------
``DEFAULT_BURST_S`` (2 s of refill): holds the seed's long request (467.6 accelerator-ms) at
   a 250 ms/s share, while an idle tenant's saved-up burst occupies its class for at most about
   two seconds of its own share.
Full-bucket rule: a request costlier than the whole bucket passes when the bucket is full and
   drives it negative; otherwise it could never pass, and the long-run rate still holds.
``borrow_fraction`` (default 0.5): bounds what a tenant holds of its neighbours' idle capacity,
   and therefore how far a returning lender's guarantee is over-committed.
Debt blocks borrowing: otherwise neighbours would refinance a chronic underpredictor.
``max_concurrent``: in-flight plus queued requests; bounds the scheduler memory and queue slots
   one tenant can hold. Retry after: the predicted end of its soonest-ending open request.
``max_queued_ms``: predicted accelerator-ms waiting (reserved, not started); one tenant's
   backlog must not become everyone's queue wait. One request may always queue when the
   tenant has nothing queued. Retry after: the excess drained at the tenant's own rate.
``max_input_tokens`` / ``max_output_tokens``: live-token memory grows with length; the seed
   asks to limit context/output length per tenant.
Live-token-ms are tenant-level only (no borrowing): held sequence memory cannot be recalled
   from a borrower without preemption, which this gateway does not do.
``_EPSILON_MS``: float slack in comparisons, so retrying exactly at ``retry_after_ms`` passes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from itertools import count
from typing import Final, Literal, Protocol

import msgspec

from gateway.core.errors import PermissionDenied, ResourceExhausted
from gateway.core.record import RequestRecord

__all__ = [
    "DEFAULT_BORROW_FRACTION",
    "DEFAULT_BURST_S",
    "POOL_TENANT",
    "RULE_ACCELERATOR_MS",
    "RULE_CONCURRENCY",
    "RULE_LIVE_TOKEN_MS",
    "RULE_MAX_INPUT_TOKENS",
    "RULE_MAX_OUTPUT_TOKENS",
    "RULE_QUEUED_WORK",
    "AccountTerms",
    "ClassShareConfig",
    "Outstanding",
    "QuotaAccounts",
    "QuotaConfig",
    "QuotaLedger",
    "QuotaSettings",
    "QuotaView",
    "Reservation",
    "Settlement",
    "quota_refusal",
]

POOL_TENANT: Final = "*"  # account name of a class's shared default pool; not a valid tenant name
DEFAULT_BURST_S: Final = 2.0  # bucket capacity in seconds of refill (reason in the module docstring)
DEFAULT_BORROW_FRACTION: Final = 0.5
_EPSILON_MS: Final = 1e-6

RULE_ACCELERATOR_MS: Final = "quota.accelerator_ms"
RULE_LIVE_TOKEN_MS: Final = "quota.live_token_ms"
RULE_CONCURRENCY: Final = "quota.concurrency"
RULE_QUEUED_WORK: Final = "quota.queued_work"
RULE_MAX_INPUT_TOKENS: Final = "quota.max_input_tokens"
RULE_MAX_OUTPUT_TOKENS: Final = "quota.max_output_tokens"


# --------------------------------------------------------------------------- configuration


# Plain frozen values: the file schema (bounds, unknown keys, the checks below) is
# ``gateway.settings.QuotaSettingsSchema``'s, which builds these once when configuration loads.


@dataclass(frozen=True, slots=True)
class QuotaConfig:
    """One tenant's quota in one request class (or the class's shared ``default`` pool)."""

    accelerator_ms_per_s: float | None = None  # own refill rate; unset: `weight` of the class share
    weight: float = 1.0  # share of the class rate when no rate is set
    burst_ms: float | None = None  # bucket capacity; unset: 2 s of refill
    live_token_ms_per_s: float | None = None  # live-token-ms refill; unset: none
    live_token_burst_ms: float | None = None  # unset: 2 s of refill
    max_concurrent: int | None = None  # open requests: in flight + queued
    max_queued_ms: float | None = None  # predicted accelerator-ms waiting
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None
    borrow_fraction: float = DEFAULT_BORROW_FRACTION  # borrowable share of burst_ms


@dataclass(frozen=True, slots=True)
class ClassShareConfig:
    """A request class's whole share: the parent bucket of its tenants."""

    accelerator_ms_per_s: float
    burst_ms: float | None = None  # unset: 2 s of refill
    default: QuotaConfig | None = None  # shared pool of unconfigured tenants


@dataclass(frozen=True, slots=True)
class QuotaSettings:
    """All quota configuration: class shares and tenant -> request class -> quota."""

    classes: dict[str, ClassShareConfig] = field(default_factory=dict)
    tenants: dict[str, dict[str, QuotaConfig]] = field(default_factory=dict)

    def check(self) -> None:
        """Raise ``ValueError`` when these settings cannot be served: the reserved pool name
        used as a tenant, or a weighted rate that cannot be derived."""
        if POOL_TENANT in self.tenants:
            raise ValueError(f"tenant name {POOL_TENANT!r} is reserved for a class's default pool")
        self.resolved_rates()  # raises ValueError when a weighted rate cannot be derived

    def scaled(self, fraction: float) -> QuotaSettings:
        """These settings with every rate, burst and limit times ``fraction`` (0 < fraction <= 1).

        One replica's share of a fleet's quotas (``fraction`` = 1/N) when the replicas cannot
        share one ledger: N such ledgers together grant at most what one grants. Counts
        (``max_concurrent``) round down but stay at least 1; length caps are not shares."""
        if not (0 < fraction <= 1):
            raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")

        def part(value: float | None) -> float | None:
            return None if value is None else value * fraction

        def account(config: QuotaConfig) -> QuotaConfig:
            concurrent = config.max_concurrent
            return replace(
                config,
                accelerator_ms_per_s=part(config.accelerator_ms_per_s),
                burst_ms=part(
                    config.burst_ms
                    if config.burst_ms is not None or config.accelerator_ms_per_s is None
                    else DEFAULT_BURST_S * config.accelerator_ms_per_s
                ),
                live_token_ms_per_s=part(config.live_token_ms_per_s),
                live_token_burst_ms=part(config.live_token_burst_ms),
                max_concurrent=None if concurrent is None else max(1, int(concurrent * fraction)),
                max_queued_ms=part(config.max_queued_ms),
            )

        return QuotaSettings(
            classes={
                name: replace(
                    share,
                    accelerator_ms_per_s=share.accelerator_ms_per_s * fraction,
                    burst_ms=part(share.burst_ms),
                    default=None if share.default is None else account(share.default),
                )
                for name, share in self.classes.items()
            },
            tenants={
                tenant: {request_class: account(c) for request_class, c in per_class.items()}
                for tenant, per_class in self.tenants.items()
            },
        )

    def resolved_rates(self) -> dict[tuple[str, str], float]:
        """Accelerator-ms/s of every account, weighted ones derived from their class share."""
        members: dict[str, list[tuple[str, QuotaConfig]]] = {}
        for tenant, per_class in self.tenants.items():
            for request_class, config in per_class.items():
                members.setdefault(request_class, []).append((tenant, config))
        for request_class, share in self.classes.items():
            if share.default is not None:
                members.setdefault(request_class, []).append((POOL_TENANT, share.default))
        rates: dict[tuple[str, str], float] = {}
        for request_class, accounts in members.items():
            explicit = sum(c.accelerator_ms_per_s or 0.0 for _, c in accounts)
            weighted = [(t, c) for t, c in accounts if c.accelerator_ms_per_s is None]
            class_share = self.classes.get(request_class)
            if weighted and class_share is None:
                names = ", ".join(t for t, _ in weighted)
                raise ValueError(
                    f"class {request_class!r}: {names} set no accelerator_ms_per_s and the class has no share"
                )
            remaining = (class_share.accelerator_ms_per_s if class_share else 0.0) - explicit
            if weighted and remaining <= 0:
                raise ValueError(
                    f"class {request_class!r}: explicit rates use the whole class share, "
                    "weighted tenants would get none"
                )
            total_weight = sum(c.weight for _, c in weighted)
            for tenant, config in accounts:
                rate = config.accelerator_ms_per_s
                rates[(tenant, request_class)] = (
                    rate if rate is not None else remaining * config.weight / total_weight
                )
        return rates


# --------------------------------------------------------------------------- values handed out


class Reservation(msgspec.Struct, frozen=True, gc=False):
    """An admission's hold on quota. Hand it back to ``start``/``settle``/``release``."""

    id: int
    tenant: str
    request_class: str
    demand_ms: float  # predicted accelerator-ms reserved
    live_token_ms: float  # predicted live-token-ms reserved
    borrowed_ms: float  # part of demand_ms admitted on the class's idle tokens
    reserved_at: float
    metered: bool  # False: no quota applies (failed open; say so in the decision log)
    pooled: bool  # True: charged to the class's shared default pool


class Settlement(msgspec.Struct, frozen=True, gc=False):
    """How one reservation closed: the ``Settled`` event's payload."""

    reservation_id: int
    kind: Literal["settled", "released"]
    predicted_ms: float
    charged_ms: float
    refunded_ms: float  # predicted - charged when positive
    extra_ms: float  # charged - predicted when positive
    predicted_live_token_ms: float
    charged_live_token_ms: float


@dataclass(frozen=True, slots=True)
class Outstanding:
    """Open reservations, all accounts together. Zero everywhere when nothing is in flight."""

    count: int
    accelerator_ms: float
    live_token_ms: float
    borrowed_ms: float


class QuotaView(msgspec.Struct, frozen=True, gc=False):
    """An account's state at ``now``, for policy (``tenant.available_accelerator_ms``) and metrics.

    Unmetered accounts report infinite availability and zero rates; ``concurrent`` and
    ``queued_ms`` are not tracked for them (0). ``None`` limits mean no limit.
    """

    tenant: str
    request_class: str
    metered: bool
    pooled: bool
    available_accelerator_ms: float  # bucket level; negative while in debt
    refill_ms_per_s: float
    burst_ms: float
    borrowable_ms: float  # what it could borrow now from the class's idle capacity
    available_live_token_ms: float
    live_token_refill_ms_per_s: float
    concurrent: int
    max_concurrent: int | None
    queued_ms: float
    max_queued_ms: float | None
    max_input_tokens: int | None
    max_output_tokens: int | None


@dataclass(frozen=True, slots=True)
class AccountTerms:
    """One account's resolved buckets and limits: what a shared store's script applies.

    ``tenant`` is the account's name (``"*"`` for a class's default pool). ``metered=False``:
    no bucket of its own (only the class share, if any, is debited). ``class_rate_ms_per_s``
    is ``None`` when the request class has no share. Unset limits are ``None``."""

    tenant: str
    request_class: str
    metered: bool
    pooled: bool
    rate_ms_per_s: float
    capacity_ms: float
    live_token_rate_ms_per_s: float | None
    live_token_capacity_ms: float | None
    borrow_limit_ms: float
    max_concurrent: int | None
    max_queued_ms: float | None
    class_rate_ms_per_s: float | None
    class_capacity_ms: float | None


class QuotaAccounts(Protocol):
    """What closing a reservation needs of a quota ledger (``settlement`` uses this): the
    in-memory ``QuotaLedger`` and a shared store that applies the same rules elsewhere."""

    def start(self, reservation: Reservation, *, now: float) -> bool: ...

    def settle(
        self,
        reservation: Reservation,
        *,
        charged_ms: float,
        charged_live_token_ms: float | None = None,
        now: float,
    ) -> Settlement | None: ...

    def release(self, reservation: Reservation, *, now: float) -> Settlement | None: ...


def quota_refusal(
    terms: AccountTerms,
    rule: str,
    retry_after_ms: int,
    *,
    need: float = 0.0,
    level: float = 0.0,
    open_count: int = 0,
    queued_ms: float = 0.0,
) -> ResourceExhausted:
    """The refusal for ``rule`` on this account: one wording whichever ledger decided.

    ``need``/``level`` are the bucket's (accelerator-ms or live-token-ms by ``rule``);
    ``open_count`` for the concurrency rule, ``queued_ms`` for the queued-work rule. A
    default pool's refusal carries no numbers: they are other tenants' numbers too."""
    cls = terms.request_class
    if rule == RULE_ACCELERATOR_MS:
        message = (
            f"the shared accelerator-ms quota of class {cls!r} is exhausted"
            if terms.pooled
            else f"accelerator-ms quota of class {cls!r} exhausted: the request needs "
            f"{need:.1f} ms, {level:.1f} ms available, refill {terms.rate_ms_per_s:g} ms/s"
        )
    elif rule == RULE_LIVE_TOKEN_MS:
        message = (
            f"the shared live-token-ms quota of class {cls!r} is exhausted"
            if terms.pooled
            else f"live-token-ms quota of class {cls!r} exhausted: the request needs "
            f"{need:.0f}, {level:.0f} available, refill {terms.live_token_rate_ms_per_s or 0.0:g}/s"
        )
    elif rule == RULE_CONCURRENCY:
        message = (
            f"the shared concurrency limit of class {cls!r} is reached"
            if terms.pooled
            else f"{open_count} requests of class {cls!r} are open (limit {terms.max_concurrent})"
        )
    elif rule == RULE_QUEUED_WORK:
        message = (
            f"the shared queued-work limit of class {cls!r} is reached"
            if terms.pooled
            else f"{queued_ms:.1f} accelerator-ms of class {cls!r} already queued "
            f"(limit {terms.max_queued_ms or 0.0:g} ms)"
        )
    else:
        raise ValueError(f"not a quota refusal rule: {rule!r}")
    return ResourceExhausted(message, rule=rule, retry_after_ms=retry_after_ms)


# --------------------------------------------------------------------------- internal state


@dataclass(slots=True)
class _Bucket:
    rate_ms_per_s: float
    capacity_ms: float
    level_ms: float
    updated_at: float | None = None  # None: untouched since construction, still full

    @classmethod
    def full(cls, rate_ms_per_s: float, capacity_ms: float | None) -> _Bucket:
        capacity = capacity_ms if capacity_ms is not None else DEFAULT_BURST_S * rate_ms_per_s
        return cls(rate_ms_per_s, capacity, capacity)

    # ``level_at`` runs several times per request: it spells out the builtins' ``max(0.0, x)``
    # (x only if x > 0.0) and ``min(cap, x)`` (x only if x < cap) as comparisons, which pick
    # the same operand (NaN included) without the calls.

    def level_at(self, now: float) -> float:
        updated_at = self.updated_at
        if updated_at is None:
            return self.level_ms
        elapsed_s = now - updated_at
        if not elapsed_s > 0.0:  # an earlier `now` is read as no time passing
            elapsed_s = 0.0
        level = self.level_ms + self.rate_ms_per_s * elapsed_s
        capacity = self.capacity_ms
        return level if level < capacity else capacity

    def refill(self, now: float) -> None:
        updated_at = self.updated_at
        self.level_ms = self.level_at(now)
        if updated_at is None or now > updated_at:  # max(updated_at, now)
            self.updated_at = now

    def debit(self, amount_ms: float) -> None:
        self.level_ms -= amount_ms  # may go negative: debt delays the next admission

    def credit(self, amount_ms: float) -> None:
        self.level_ms = min(self.capacity_ms, self.level_ms + amount_ms)

    def covers(self, need_ms: float) -> bool:
        return self.level_ms >= need_ms - _EPSILON_MS

    def need_for(self, demand_ms: float) -> float:
        return min(demand_ms, self.capacity_ms)  # the full-bucket rule

    def wait_ms(self, need_ms: float) -> int:
        """Whole ms of refill until the level covers ``need_ms`` (after ``refill``)."""
        deficit = need_ms - self.level_ms - _EPSILON_MS
        if deficit <= 0:
            return 0
        return max(1, math.ceil(deficit / self.rate_ms_per_s * 1000.0))


@dataclass(slots=True)
class _Account:
    tenant: str
    request_class: str
    config: QuotaConfig
    accelerator: _Bucket
    live_token: _Bucket | None
    borrow_limit_ms: float
    open_ids: set[int] = field(default_factory=set)
    queued_ids: set[int] = field(default_factory=set)
    queued_ms: float = 0.0
    borrowed_ms: float = 0.0

    @property
    def pooled(self) -> bool:
        return self.tenant == POOL_TENANT


class _Open(msgspec.Struct):
    reservation: Reservation
    account: _Account | None
    parent: _Bucket | None
    started_at: float | None = None


@dataclass(frozen=True, slots=True)
class _Refusal:
    rule: str
    retry_after_ms: int
    message: str


def _check_amount(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")


def _check_now(now: float) -> None:
    if not math.isfinite(now):
        raise ValueError(f"now must be finite, got {now!r}")


# The request path's ledger calls check their arguments inline, ``_isfinite(x) and x >= 0``
# being ``_check_amount``'s test (evaluated in the same order, so even its errors are the
# same), and call the checks above, which raise the named error, only when one fails.
_isfinite = math.isfinite


# --------------------------------------------------------------------------- the ledger


class QuotaLedger:
    """Hierarchical reserve-then-settle quota state for every configured account."""

    def __init__(self, settings: QuotaSettings) -> None:
        self._settings = settings
        self._classes: dict[str, _Bucket] = {
            name: _Bucket.full(share.accelerator_ms_per_s, share.burst_ms)
            for name, share in settings.classes.items()
        }
        settings.check()
        rates = settings.resolved_rates()
        configs: dict[tuple[str, str], QuotaConfig] = {
            (tenant, request_class): config
            for tenant, per_class in settings.tenants.items()
            for request_class, config in per_class.items()
        }
        for request_class, share in settings.classes.items():
            if share.default is not None:
                configs[(POOL_TENANT, request_class)] = share.default
        self._accounts: dict[tuple[str, str], _Account] = {}
        for key, config in configs.items():
            accelerator = _Bucket.full(rates[key], config.burst_ms)
            live = (
                _Bucket.full(config.live_token_ms_per_s, config.live_token_burst_ms)
                if config.live_token_ms_per_s is not None
                else None
            )
            self._accounts[key] = _Account(
                tenant=key[0],
                request_class=key[1],
                config=config,
                accelerator=accelerator,
                live_token=live,
                borrow_limit_ms=config.borrow_fraction * accelerator.capacity_ms,
            )
        self._open: dict[int, _Open] = {}
        self._ids = count(1)

    @property
    def settings(self) -> QuotaSettings:
        return self._settings

    def accounts(self) -> tuple[tuple[str, str], ...]:
        """(tenant, request class) of every account with state; ``"*"`` names a default pool."""
        return tuple(self._accounts)

    def terms(self, tenant: str, request_class: str) -> AccountTerms:
        """The account a (tenant, class) request draws on, resolved: its name and numbers."""
        account = self._account_for(tenant, request_class)
        parent = self._classes.get(request_class)
        class_rate = parent.rate_ms_per_s if parent is not None else None
        class_capacity = parent.capacity_ms if parent is not None else None
        if account is None:
            return AccountTerms(
                tenant, request_class, False, False, 0.0, 0.0, None, None, 0.0, None, None,
                class_rate, class_capacity,
            )  # fmt: skip
        live = account.live_token
        return AccountTerms(
            tenant=account.tenant,
            request_class=request_class,
            metered=True,
            pooled=account.pooled,
            rate_ms_per_s=account.accelerator.rate_ms_per_s,
            capacity_ms=account.accelerator.capacity_ms,
            live_token_rate_ms_per_s=live.rate_ms_per_s if live is not None else None,
            live_token_capacity_ms=live.capacity_ms if live is not None else None,
            borrow_limit_ms=account.borrow_limit_ms,
            max_concurrent=account.config.max_concurrent,
            max_queued_ms=account.config.max_queued_ms,
            class_rate_ms_per_s=class_rate,
            class_capacity_ms=class_capacity,
        )

    def check_lengths(self, tenant: str, request_class: str, input_tokens: int, output_tokens: int) -> None:
        """Raise ``PermissionDenied`` for a context or output over the account's length caps."""
        account = self._account_for(tenant, request_class)
        if account is not None:
            self._check_lengths(account, input_tokens, output_tokens)

    # ------------------------------------------------------------------ admission

    def reserve(
        self,
        tenant: str,
        request_class: str,
        *,
        demand_ms: float,
        live_token_ms: float = 0.0,
        input_tokens: int = 0,
        output_tokens: int = 0,
        now: float,
        open_elsewhere: Sequence[float] = (),
    ) -> Reservation:
        """Reserve the predicted demand, or raise ``ResourceExhausted`` / ``PermissionDenied``.

        ``open_elsewhere``: the predicted demands (ms) of this account's requests open outside
        this ledger, which the concurrency rule counts with its own (a fleet replica's degraded
        share: its reservations still open in Redis)."""
        if not (
            _isfinite(demand_ms)
            and demand_ms >= 0
            and _isfinite(live_token_ms)
            and live_token_ms >= 0
            and _isfinite(input_tokens)
            and input_tokens >= 0
            and _isfinite(output_tokens)
            and output_tokens >= 0
            and _isfinite(now)
        ):
            _check_amount("demand_ms", demand_ms)
            _check_amount("live_token_ms", live_token_ms)
            _check_amount("input_tokens", input_tokens)
            _check_amount("output_tokens", output_tokens)
            _check_now(now)
        account = self._account_for(tenant, request_class)
        parent = self._classes.get(request_class)
        if account is None:
            if parent is not None:
                parent.refill(now)
                parent.debit(demand_ms)
            return self._open_reservation(
                tenant, request_class, demand_ms, live_token_ms, 0.0, now, account=None, parent=parent
            )

        self._check_lengths(account, input_tokens, output_tokens)
        if parent is not None:
            parent.refill(now)
        account.accelerator.refill(now)
        if account.live_token is not None:
            account.live_token.refill(now)

        refusals: list[_Refusal] = []
        if (refusal := self._concurrency_refusal(account, now, open_elsewhere)) is not None:
            refusals.append(refusal)
        if (refusal := self._queued_work_refusal(account, demand_ms)) is not None:
            refusals.append(refusal)
        if (refusal := self._live_token_refusal(account, live_token_ms)) is not None:
            refusals.append(refusal)
        borrowed_ms = self._accelerator_grant(account, parent, demand_ms)
        if borrowed_ms is None:
            refusals.append(self._accelerator_refusal(account, demand_ms))
        if refusals:
            worst = max(refusals, key=lambda r: r.retry_after_ms)
            raise ResourceExhausted(worst.message, rule=worst.rule, retry_after_ms=worst.retry_after_ms)
        assert borrowed_ms is not None  # refused above otherwise

        account.accelerator.debit(demand_ms - borrowed_ms)  # a borrower spends its own remainder first
        if parent is not None:
            parent.debit(demand_ms)
        if account.live_token is not None:
            account.live_token.debit(live_token_ms)
        account.borrowed_ms += borrowed_ms
        account.queued_ms += demand_ms
        reservation = self._open_reservation(
            tenant, request_class, demand_ms, live_token_ms, borrowed_ms, now, account=account, parent=parent
        )
        account.open_ids.add(reservation.id)
        account.queued_ids.add(reservation.id)
        return reservation

    def reserve_record(self, record: RequestRecord, *, now: float) -> Reservation:
        """``reserve`` for an admission record: its tenant, class, predicted demand and shape."""
        return self.reserve(
            record.identity.tenant,
            record.identity.request_class,
            demand_ms=record.demand.accelerator_ms,
            live_token_ms=record.demand.live_token_ms,
            input_tokens=record.shape.input_tokens,
            output_tokens=record.shape.max_output_tokens,
            now=now,
        )

    def start(self, reservation: Reservation, *, now: float) -> bool:
        """Mark a reservation dispatched (it stops counting as queued work). False if not open or already."""
        if not _isfinite(now):
            _check_now(now)
        entry = self._entry(reservation)
        if entry is None or entry.started_at is not None:
            return False
        entry.started_at = now
        account = entry.account
        if account is not None:
            account.queued_ids.discard(reservation.id)
            account.queued_ms = (
                max(0.0, account.queued_ms - reservation.demand_ms) if account.queued_ids else 0.0
            )
        return True

    def settle(
        self,
        reservation: Reservation,
        *,
        charged_ms: float,
        charged_live_token_ms: float | None = None,
        now: float,
    ) -> Settlement | None:
        """Correct a reservation with the observed charge. ``None``: it was already closed.

        ``charged_live_token_ms=None`` charges the live-token-ms as predicted.
        """
        if not (
            _isfinite(charged_ms)
            and charged_ms >= 0
            and (
                charged_live_token_ms is None
                or (_isfinite(charged_live_token_ms) and charged_live_token_ms >= 0)
            )
            and _isfinite(now)
        ):
            _check_amount("charged_ms", charged_ms)
            if charged_live_token_ms is not None:
                _check_amount("charged_live_token_ms", charged_live_token_ms)
            _check_now(now)
        live = reservation.live_token_ms if charged_live_token_ms is None else charged_live_token_ms
        return self._close(reservation, charged_ms, live, now, "settled")

    def release(self, reservation: Reservation, *, now: float) -> Settlement | None:
        """Refund a reservation whose request never ran. ``None``: it was already closed.

        A request cancelled while executing has done work: ``settle`` it with the observed charge.
        """
        _check_now(now)
        return self._close(reservation, 0.0, 0.0, now, "released")

    # ------------------------------------------------------------------ observation

    def outstanding(self) -> Outstanding:
        entries = [e.reservation for e in self._open.values()]
        return Outstanding(
            count=len(entries),
            accelerator_ms=sum(r.demand_ms for r in entries),
            live_token_ms=sum(r.live_token_ms for r in entries),
            borrowed_ms=sum(r.borrowed_ms for r in entries),
        )

    def available(self, tenant: str, request_class: str, *, now: float) -> QuotaView:
        """The account's state at ``now``. Reads only: creates no state, refills nothing."""
        if not _isfinite(now):
            _check_now(now)
        account = self._account_for(tenant, request_class)
        if account is None:
            return QuotaView(
                tenant=tenant,
                request_class=request_class,
                metered=False,
                pooled=False,
                available_accelerator_ms=math.inf,
                refill_ms_per_s=0.0,
                burst_ms=math.inf,
                borrowable_ms=0.0,
                available_live_token_ms=math.inf,
                live_token_refill_ms_per_s=0.0,
                concurrent=0,
                max_concurrent=None,
                queued_ms=0.0,
                max_queued_ms=None,
                max_input_tokens=None,
                max_output_tokens=None,
            )
        config = account.config
        level = account.accelerator.level_at(now)
        parent = self._classes.get(request_class)
        borrowable = 0.0
        if parent is not None and level >= 0:
            headroom = account.borrow_limit_ms - account.borrowed_ms
            borrowable = max(0.0, min(headroom, parent.level_at(now)))
        live = account.live_token
        return QuotaView(
            tenant=tenant,
            request_class=request_class,
            metered=True,
            pooled=account.pooled,
            available_accelerator_ms=level,
            refill_ms_per_s=account.accelerator.rate_ms_per_s,
            burst_ms=account.accelerator.capacity_ms,
            borrowable_ms=borrowable,
            available_live_token_ms=live.level_at(now) if live is not None else math.inf,
            live_token_refill_ms_per_s=live.rate_ms_per_s if live is not None else 0.0,
            concurrent=len(account.open_ids),
            max_concurrent=config.max_concurrent,
            queued_ms=account.queued_ms,
            max_queued_ms=config.max_queued_ms,
            max_input_tokens=config.max_input_tokens,
            max_output_tokens=config.max_output_tokens,
        )

    # ------------------------------------------------------------------ internals

    def _account_for(self, tenant: str, request_class: str) -> _Account | None:
        account = self._accounts.get((tenant, request_class))
        if account is None and tenant != POOL_TENANT:
            account = self._accounts.get((POOL_TENANT, request_class))
        return account

    def _entry(self, reservation: Reservation) -> _Open | None:
        entry = self._open.get(reservation.id)
        # closed, or another ledger's (the very object handed out is equal to itself: no
        # field-by-field comparison needed)
        if entry is None or (entry.reservation is not reservation and entry.reservation != reservation):
            return None
        return entry

    def _open_reservation(
        self,
        tenant: str,
        request_class: str,
        demand_ms: float,
        live_token_ms: float,
        borrowed_ms: float,
        now: float,
        *,
        account: _Account | None,
        parent: _Bucket | None,
    ) -> Reservation:
        reservation = Reservation(
            id=next(self._ids),
            tenant=tenant,
            request_class=request_class,
            demand_ms=demand_ms,
            live_token_ms=live_token_ms,
            borrowed_ms=borrowed_ms,
            reserved_at=now,
            metered=account is not None,
            pooled=account is not None and account.pooled,
        )
        self._open[reservation.id] = _Open(reservation, account, parent)
        return reservation

    def _close(
        self,
        reservation: Reservation,
        charged_ms: float,
        charged_live_token_ms: float,
        now: float,
        kind: Literal["settled", "released"],
    ) -> Settlement | None:
        entry = self._entry(reservation)
        if entry is None:
            return None
        del self._open[reservation.id]
        delta = charged_ms - reservation.demand_ms
        if entry.parent is not None:
            entry.parent.refill(now)
            if delta >= 0:
                entry.parent.debit(delta)
            else:
                entry.parent.credit(-delta)
        account = entry.account
        if account is not None:
            account.accelerator.refill(now)
            # The loan is spent first; the own bucket pays max(0, charged - borrowed), so an
            # underprediction is the tenant's to pay and a refund returns its own part first.
            if delta >= 0:
                account.accelerator.debit(delta)
            else:
                own_part = reservation.demand_ms - reservation.borrowed_ms
                account.accelerator.credit(min(own_part, -delta))
            if account.live_token is not None:
                account.live_token.refill(now)
                live_delta = charged_live_token_ms - reservation.live_token_ms
                if live_delta >= 0:
                    account.live_token.debit(live_delta)
                else:
                    account.live_token.credit(-live_delta)
            account.open_ids.discard(reservation.id)
            if reservation.id in account.queued_ids:
                account.queued_ids.discard(reservation.id)
                account.queued_ms -= reservation.demand_ms
            # Running sums snap to exact zero when nothing is open, so float residue cannot accrue.
            account.queued_ms = max(0.0, account.queued_ms) if account.queued_ids else 0.0
            account.borrowed_ms = (
                max(0.0, account.borrowed_ms - reservation.borrowed_ms) if account.open_ids else 0.0
            )
        return Settlement(
            reservation_id=reservation.id,
            kind=kind,
            predicted_ms=reservation.demand_ms,
            charged_ms=charged_ms,
            refunded_ms=max(0.0, -delta),
            extra_ms=max(0.0, delta),
            predicted_live_token_ms=reservation.live_token_ms,
            charged_live_token_ms=charged_live_token_ms,
        )

    def _accelerator_grant(self, account: _Account, parent: _Bucket | None, demand_ms: float) -> float | None:
        """Borrowed part of an admissible demand (0.0: own tokens pay), or None if it cannot pass."""
        own = account.accelerator
        if own.covers(own.need_for(demand_ms)):
            return 0.0
        if parent is None or account.borrow_limit_ms <= 0 or own.level_ms < -_EPSILON_MS:
            return None  # no class to borrow from, borrowing off, or in debt
        borrowed = demand_ms - max(0.0, own.level_ms)
        if account.borrowed_ms + borrowed > account.borrow_limit_ms + _EPSILON_MS:
            return None
        # The parent's level is the class's unused capacity, including this tenant's own remainder.
        if not parent.covers(demand_ms):
            return None
        return borrowed

    def _refusal(
        self,
        account: _Account,
        rule: str,
        wait: int,
        *,
        need: float = 0.0,
        level: float = 0.0,
        open_count: int = 0,
        queued_ms: float = 0.0,
    ) -> _Refusal:
        terms = self.terms(account.tenant, account.request_class)
        error = quota_refusal(
            terms, rule, wait, need=need, level=level, open_count=open_count, queued_ms=queued_ms
        )
        return _Refusal(rule, wait, error.message)

    def _accelerator_refusal(self, account: _Account, demand_ms: float) -> _Refusal:
        bucket = account.accelerator
        need = bucket.need_for(demand_ms)
        # Waiting for the own bucket is an upper bound: by then the guarantee alone covers it.
        return self._refusal(
            account, RULE_ACCELERATOR_MS, bucket.wait_ms(need), need=need, level=bucket.level_ms
        )

    def _live_token_refusal(self, account: _Account, live_token_ms: float) -> _Refusal | None:
        bucket = account.live_token
        if bucket is None:
            return None
        need = bucket.need_for(live_token_ms)
        if bucket.covers(need):
            return None
        return self._refusal(
            account, RULE_LIVE_TOKEN_MS, bucket.wait_ms(need), need=need, level=bucket.level_ms
        )

    def _concurrency_refusal(
        self, account: _Account, now: float, open_elsewhere: Sequence[float]
    ) -> _Refusal | None:
        limit = account.config.max_concurrent
        open_count = len(account.open_ids) + len(open_elsewhere)
        if limit is None or open_count < limit:
            return None
        # Predicted end of the soonest-ending open request. Queued ones need at least a full
        # execution; one running past its prediction is expected to need up to one more.
        # Those open elsewhere: their whole prediction (their start is not known here).
        soonest = min(open_elsewhere, default=math.inf)
        for reservation_id in account.open_ids:
            entry = self._open[reservation_id]
            demand = entry.reservation.demand_ms
            remaining = demand
            if entry.started_at is not None:
                remaining = demand - (now - entry.started_at) * 1000.0
                if remaining <= 0:
                    remaining = demand
            soonest = min(soonest, remaining)
        wait = max(1, math.ceil(soonest)) if math.isfinite(soonest) else 1
        return self._refusal(account, RULE_CONCURRENCY, wait, open_count=open_count)

    def _queued_work_refusal(self, account: _Account, demand_ms: float) -> _Refusal | None:
        limit = account.config.max_queued_ms
        queued = account.queued_ms
        if limit is None or not account.queued_ids or queued + demand_ms <= limit + _EPSILON_MS:
            return None
        # With nothing queued one request always may wait, so at most the queued work must drain;
        # it drains at least at the tenant's own rate under a share-aware scheduler.
        excess = min(queued, queued + demand_ms - limit)
        wait = max(1, math.ceil((excess - _EPSILON_MS) / account.accelerator.rate_ms_per_s * 1000.0))
        return self._refusal(account, RULE_QUEUED_WORK, wait, queued_ms=queued)

    def _check_lengths(self, account: _Account, input_tokens: int, output_tokens: int) -> None:
        config = account.config
        if config.max_input_tokens is not None and input_tokens > config.max_input_tokens:
            raise PermissionDenied(
                f"input of {input_tokens} tokens exceeds this tenant's limit of {config.max_input_tokens} "
                f"in class {account.request_class!r}",
                rule=RULE_MAX_INPUT_TOKENS,
            )
        if config.max_output_tokens is not None and output_tokens > config.max_output_tokens:
            raise PermissionDenied(
                f"output of up to {output_tokens} tokens exceeds this tenant's limit of "
                f"{config.max_output_tokens} in class {account.request_class!r}",
                rule=RULE_MAX_OUTPUT_TOKENS,
            )
