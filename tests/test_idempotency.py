"""Online idempotency's state machine (``gateway.core.idempotency``), driven by hand."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.idempotency import ENTRY_BYTES, OperationTable, Step

A, B = b"a" * 16, b"b" * 16


def test_a_retry_joins_in_flight_then_replays_the_same_answer_inside_the_window() -> None:
    table = OperationTable(window_s=300.0)
    assert table.begin("orchid", "op-1", A, now=0.0).step is Step.START
    assert table.begin("orchid", "op-1", A, now=0.1).step is Step.JOIN  # in flight: does not run
    table.finish("orchid", "op-1", b"answer", now=1.0)
    replay = table.begin("orchid", "op-1", A, now=300.9)
    assert (replay.step, replay.answer) == (Step.REPLAY, b"answer")
    # The window has passed: the id is free again (a new operation).
    assert table.begin("orchid", "op-1", A, now=301.0).step is Step.START


def test_ids_are_per_tenant_and_a_different_request_never_gets_the_answer() -> None:
    table = OperationTable()
    assert table.begin("orchid", "op-1", A, now=0.0).step is Step.START
    assert table.begin("lumen", "op-1", B, now=0.0).step is Step.START  # another tenant's id
    conflict = table.begin("orchid", "op-1", B, now=0.1)
    assert conflict.step is Step.CONFLICT and "different request" in conflict.message
    table.finish("orchid", "op-1", b"answer", now=1.0)
    conflict = table.begin("orchid", "op-1", B, now=2.0)
    assert conflict.step is Step.CONFLICT and conflict.answer is None


def test_a_failed_attempt_leaves_nothing_and_the_next_retry_runs() -> None:
    table = OperationTable()
    assert table.begin("orchid", "op-1", A, now=0.0).step is Step.START
    table.fail("orchid", "op-1")
    assert len(table) == 0
    assert table.begin("orchid", "op-1", A, now=1.0).step is Step.START


def test_an_answer_too_large_to_hold_is_gone_but_not_run_again() -> None:
    table = OperationTable(max_answer_bytes=10)
    table.begin("orchid", "big", A, now=0.0)
    table.finish("orchid", "big", b"x" * 11, now=1.0)
    gone = table.begin("orchid", "big", A, now=2.0)
    assert gone.step is Step.GONE and "no longer held" in gone.message


def test_bounded_memory_gives_up_old_answers_first_and_never_forgets_an_id_inside_its_window() -> None:
    table = OperationTable(max_entries=3, max_bytes=3 * ENTRY_BYTES + 100, max_answer_bytes=100)
    for i in range(2):
        table.begin("orchid", f"op-{i}", A, now=float(i))
        table.finish("orchid", f"op-{i}", b"x" * 60, now=float(i))
    assert table.begin("orchid", "op-0", A, now=5.0).step is Step.REPLAY
    # A third id does not fit beside both answers: the older answer's bytes are given up, its
    # id is kept (a retry is told it completed, and is not run again).
    assert table.begin("orchid", "op-2", A, now=5.0).step is Step.START
    assert table.begin("orchid", "op-0", A, now=5.0).step is Step.GONE
    assert table.begin("orchid", "op-1", A, now=5.0).step is Step.REPLAY
    # A fourth: no id inside its window is forgotten for room; the caller is told when.
    full = table.begin("orchid", "op-3", A, now=5.0)
    assert full.step is Step.FULL and full.retry_after_ms == 295_000  # op-0's window ends at 300 s
    assert table.begin("orchid", "op-3", A, now=300.0).step is Step.START  # op-0 expired


@settings(max_examples=200, deadline=None)
@given(
    events=st.lists(
        st.tuples(
            st.sampled_from(["begin", "finish", "fail"]),
            st.integers(0, 5),  # operation
            st.integers(0, 1),  # tenant
            st.integers(0, 300),  # answer size
            st.floats(0.0, 50.0),  # time step
        ),
        max_size=120,
    )
)
def test_the_bounds_always_hold_and_a_held_answer_is_the_one_finished(
    events: list[tuple[str, int, int, int, float]],
) -> None:
    bound = 4 * ENTRY_BYTES + 500
    table = OperationTable(window_s=100.0, max_entries=4, max_bytes=bound, max_answer_bytes=200)
    now = 0.0
    started: set[tuple[str, str]] = set()  # ids whose attempt is running (begin said START)
    answers: dict[tuple[str, str], bytes] = {}  # each id's last finished answer
    for kind, op, tenant_no, size, step in events:
        now += step
        key = (f"t{tenant_no}", f"op-{op}")
        if kind == "begin":
            begun = table.begin(*key, A, now)
            if begun.step is Step.START:
                started.add(key)
            elif begun.step is Step.REPLAY:
                assert begun.answer == answers[key]
        elif kind == "finish":
            if key in started:
                answers[key] = bytes([op]) * size
                started.discard(key)
                table.finish(*key, answers[key], now)
        elif key in started:
            started.discard(key)
            table.fail(*key)
        assert len(table) <= 4 and table.held_bytes <= bound
