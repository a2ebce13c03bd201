"""idempotency.maintain() against real concurrent sessions, and the Python side
(pg_idempotency.maintenance).

* two runs at once: the second one reports "skipped" without waiting, nobody errors;
* a run while a long transaction uses the keys table returns, the transaction still open, with
  a "skipped" entry naming the 200 ms lock timeout, and claims from other sessions keep
  succeeding meanwhile;
* a claim that waits for a run's drop sees the tombstone the run wrote (never neither);
* rows moved out of the default partition are not lost to a holder that heartbeats meanwhile;
* run_maintenance / fetch_status / format_* from pg_idempotency.maintenance.
"""

from __future__ import annotations

import re
import threading
import time
import types
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from pg_idempotency import maintenance
from pgharness import WAIT_BOUND, wait_until

CLAIM = """
SELECT outcome, lease_token FROM idempotency.claim(%s, %s, %s::jsonb,
                                                   reference_time => %s::timestamptz)
"""
MAINTAIN = "SELECT action, parent_table, partition_name, row_count, reason " \
           "FROM idempotency.maintain(%s::timestamptz)"


def day_start(conn: psycopg.Connection[Any], days: int) -> datetime:
    """00:00 UTC of the day ``days`` after today (partition bounds are UTC days)."""
    return conn.execute(
        "SELECT date_bin('1 day', now(), timestamptz '2000-01-01 00:00:00+00') "
        "+ %s * interval '1 day'", (days,)).fetchone()[0]


def old_partition_with_a_key(conn: psycopg.Connection[Any], days_ago: int, key: str) -> str:
    """Make the keys and inbox partitions of a past day, with one completed key in keys, and
    claim a key today (``<key>-today``): the partition holding the newest keys is never
    dropped (since 0.11.0), so the old one goes only when newer keys exist."""
    conn.execute("SELECT idempotency.claim('mt', %s, '{}')", (f"{key}-today",))
    lo = day_start(conn, -days_ago)
    for parent in ("keys", "inbox"):
        conn.execute("SELECT idempotency._create_partition(%s, %s, %s)",
                     (parent, lo, lo + timedelta(days=1)))
    token = conn.execute(CLAIM, ("mt", key, Jsonb({"k": key}), lo + timedelta(hours=1))
                         ).fetchone()[1]
    conn.execute("SELECT idempotency.complete('mt', %s, %s, 200, '{}', "
                 "reference_time => %s)", (key, token, lo + timedelta(hours=1, seconds=1)))
    return conn.execute("SELECT tableoid::regclass::text FROM idempotency.keys WHERE key = %s",
                        (key,)).fetchone()[0].removeprefix("idempotency.")


def exists(conn: psycopg.Connection[Any], name: str) -> bool:
    return conn.execute("SELECT to_regclass(%s) IS NOT NULL", (f"idempotency.{name}",)
                        ).fetchone()[0]


def wait_for_lock_wait(observer: psycopg.Connection[Any], pid: int, thread: threading.Thread,
                       what: str) -> None:
    deadline = time.monotonic() + WAIT_BOUND
    while time.monotonic() < deadline:
        if not thread.is_alive():
            pytest.fail(f"{what} did not wait")
        row = observer.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s",
                               (pid,)).fetchone()
        if row and row[0] == "Lock":
            return
        time.sleep(0.01)
    pytest.fail(f"{what} did not wait on a lock within {WAIT_BOUND:.0f} s")


# -- two runs at once ---------------------------------------------------------------------------


def test_a_second_run_while_one_is_active_skips_at_once(db: str) -> None:
    with psycopg.connect(db, autocommit=True) as setup:
        name = old_partition_with_a_key(setup, 5, "old")
        now = setup.execute("SELECT now()").fetchone()[0]
    with psycopg.connect(db) as first, psycopg.connect(db, autocommit=True) as second:
        steps = first.execute(MAINTAIN, (now,)).fetchall()  # transaction left open
        assert ("dropped", "keys", name, 1) in [s[:4] for s in steps], steps
        # Had it waited for the lock, it would wait for first.commit() below: for ever.
        # statement_timeout turns that hang into an error (57014) naming the statement.
        second.execute("SELECT set_config('statement_timeout', %s, false)",
                       (f"{WAIT_BOUND:.0f}s",))
        assert second.execute(MAINTAIN, (now,)).fetchall() == [
            ("skipped", None, None, None,
             "another idempotency.maintain() run holds the maintenance lock")]
        first.commit()
        assert second.execute(MAINTAIN, (now,)).fetchall() == [], "nothing left to do"
        assert not exists(second, name)


def test_runs_racing_from_many_sessions_never_error(db: str) -> None:
    with psycopg.connect(db, autocommit=True) as setup:
        names = [old_partition_with_a_key(setup, d, f"old{d}") for d in (3, 4, 5, 6)]
        now = setup.execute("SELECT now()").fetchone()[0]
    n = 6
    barrier = threading.Barrier(n, timeout=WAIT_BOUND)
    results: list[list[tuple[Any, ...]]] = []
    errors: list[BaseException] = []

    def session() -> None:
        try:
            with psycopg.connect(db, autocommit=True) as conn:
                barrier.wait()
                results.append(conn.execute(MAINTAIN, (now,)).fetchall())
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=session, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_BOUND)
    assert not any(t.is_alive() for t in threads), "a maintain() run did not return"
    assert not errors, errors[0]
    dropped = sorted(s[2] for r in results for s in r if s[0] == "dropped" and s[1] == "keys")
    assert dropped == sorted(names), results  # each partition dropped exactly once
    with psycopg.connect(db) as conn:
        assert not any(exists(conn, name) for name in names)


# -- a long transaction on the keys table -------------------------------------------------------


def test_a_long_transaction_makes_the_drop_skip_quickly_while_claims_go_on(db: str) -> None:
    with psycopg.connect(db, autocommit=True) as setup:
        name = old_partition_with_a_key(setup, 5, "old")
        inbox_name = name.replace("keys_", "inbox_")
    claim_times: list[float] = []
    claim_outcomes: list[str] = []
    stop = threading.Event()

    def claimer() -> None:
        with psycopg.connect(db, autocommit=True) as conn:
            i = 0
            while not stop.is_set():
                started = time.monotonic()
                claim_outcomes.append(conn.execute(
                    "SELECT outcome FROM idempotency.claim('live', %s, '{}')", (f"k{i}",)
                ).fetchone()[0])
                claim_times.append(time.monotonic() - started)
                i += 1

    with psycopg.connect(db) as long_tx, psycopg.connect(db, autocommit=True) as runner:
        # A reporting query left open: ACCESS SHARE on keys and its partitions until it ends.
        long_tx.execute("SELECT count(*) FROM idempotency.keys").fetchone()
        thread = threading.Thread(target=claimer, daemon=True)
        thread.start()
        wait_until(lambda: claim_outcomes or not thread.is_alive(), "the first claim")
        # maintain() returns while the long transaction is still open (waiting for it would
        # hang here): it gave up the lock after settings.maintenance_lock_timeout, which its
        # reason names. How long that took in wall-clock time depends on the machine's load.
        steps = runner.execute(MAINTAIN, (datetime.now().astimezone(),)).fetchall()
        during = len(claim_outcomes)
        # Claims go on after the run too, the long transaction still open.
        wait_until(lambda: len(claim_outcomes) >= during + 3 or not thread.is_alive(),
                   "claims after the maintain() run")
        stop.set()
        thread.join(WAIT_BOUND)
        assert not thread.is_alive(), "a claim hung"
        assert len(claim_outcomes) >= during + 3, "the claims stopped (see the thread's error)"
        skipped = [s for s in steps if s[0] == "skipped" and s[2] == name]
        assert skipped and "was not locked within 200 ms" in skipped[0][4], steps
        assert exists(runner, name), "the partition must still be there"
        # The inbox is another table: the long transaction does not hold it up.
        assert ("dropped", "inbox", inbox_name) in [s[:3] for s in steps], steps
        assert claim_outcomes and set(claim_outcomes) == {"claimed"}, claim_outcomes
        # A claim may wait behind the drop's lock request for up to the 200 ms lock_timeout;
        # behind the long transaction itself it would wait until the test ends (claims went
        # on after the run, above). The longest one is printed, not compared: a loaded machine
        # makes any claim slow.
        print(f"longest claim during maintain(): {max(claim_times):.2f} s")
        long_tx.commit()
        steps = runner.execute(MAINTAIN, (datetime.now().astimezone(),)).fetchall()
        assert ("dropped", "keys", name, 1) in [s[:4] for s in steps], steps
        assert not exists(runner, name)


# -- tombstones and a claim waiting for the drop ------------------------------------------------


def test_a_claim_waiting_for_the_drop_sees_the_tombstone(db: str) -> None:
    with psycopg.connect(db, autocommit=True) as setup:
        setup.execute("UPDATE idempotency.settings SET tombstones = true")
        name = old_partition_with_a_key(setup, 5, "old")
    result: list[tuple[Any, ...]] = []
    with psycopg.connect(db) as runner, psycopg.connect(db, autocommit=True) as client, \
            psycopg.connect(db, autocommit=True) as observer:
        steps = runner.execute(MAINTAIN, (datetime.now().astimezone(),)).fetchall()
        assert ("dropped", "keys", name, 1) in [s[:4] for s in steps], steps  # not committed

        def retry() -> None:
            result.append(client.execute(
                "SELECT outcome, response_status FROM idempotency.claim('mt', 'old', %s)",
                (Jsonb({"k": "old"}),)).fetchone())

        thread = threading.Thread(target=retry, daemon=True)
        thread.start()
        wait_for_lock_wait(observer, client.info.backend_pid, thread, "the retry")
        runner.commit()
        thread.join(WAIT_BOUND)
    assert result == [("expired", 200)], (
        "a claim that waited for the drop must see the tombstone committed with it")


# -- moving rows out of the default partition ---------------------------------------------------


def test_a_move_out_of_the_default_partition_waits_for_a_holder_and_keeps_its_token(
    db: str
) -> None:
    with psycopg.connect(db, autocommit=True) as setup:
        later = day_start(setup, 10) + timedelta(hours=1)  # no partition there yet
        token = setup.execute(CLAIM, ("mv", "k", Jsonb({}), later)).fetchone()[1]
        assert setup.execute("SELECT tableoid::regclass::text FROM idempotency.keys "
                             "WHERE scope = 'mv'").fetchone()[0] == "idempotency.keys_default"
    with psycopg.connect(db) as holder, psycopg.connect(db, autocommit=True) as runner:
        holder.execute("SELECT idempotency.heartbeat('mv', 'k', %s, reference_time => %s)",
                       (token, later))  # its transaction stays open
        steps = runner.execute(MAINTAIN, (later,)).fetchall()
        moves = [s for s in steps if s[1] == "keys" and s[2] == "keys_default"]
        # Skipped for the lock (the drops of the older partitions, first, already hit it).
        assert moves and moves[0][0] == "skipped" and "lock" in moves[0][4], steps
        holder.commit()
        steps = runner.execute(MAINTAIN, (later,)).fetchall()
        assert [s[0] for s in steps if s[1] == "keys" and s[3] == 1] == ["moved"], steps
        runner.execute("SELECT idempotency.complete('mv', 'k', %s, 200, '{}', "
                       "reference_time => %s)", (token, later + timedelta(seconds=1)))
        assert runner.execute(
            "SELECT state, tableoid::regclass::text <> 'idempotency.keys_default' "
            "FROM idempotency.keys WHERE scope = 'mv'").fetchall() == [("completed", True)]


# -- pg_idempotency.maintenance -------------------------------------------------------------------


def test_python_run_maintenance_and_report(db: str) -> None:
    with psycopg.connect(db, autocommit=True) as conn:
        name = old_partition_with_a_key(conn, 5, "old")
        steps = maintenance.run_maintenance(conn)
        assert [(s.action, s.partition_name, s.row_count) for s in steps
                if s.parent_table == "keys"] == [("dropped", name, 1)], steps
        report = maintenance.format_report(steps)
        assert report.splitlines()[0].split() == [
            "action", "table", "partition", "from", "to", "rows", "reason"]
        assert re.search(rf"^dropped +keys +{name} ", report, re.M), report
        assert maintenance.format_report(maintenance.run_maintenance(conn)) == (
            "maintenance: nothing to do")
        with conn.transaction(), pytest.raises(ValueError, match="outside a transaction"):
            maintenance.run_maintenance(conn)


def test_python_run_maintenance_retries_after_a_lock_skip(
    db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with psycopg.connect(db, autocommit=True) as conn:
        name = old_partition_with_a_key(conn, 5, "old")
    with psycopg.connect(db) as long_tx, psycopg.connect(db, autocommit=True) as conn:
        long_tx.execute("SELECT count(*) FROM idempotency.keys").fetchone()
        delays: list[float] = []

        def between_attempts(seconds: float) -> None:
            """The retry delay: the long transaction ends in it (on a clock it could end
            before the first attempt or after the second one on a loaded machine)."""
            delays.append(seconds)
            if len(delays) == 1:
                long_tx.commit()

        monkeypatch.setattr(maintenance, "time", types.SimpleNamespace(sleep=between_attempts))
        steps = maintenance.run_maintenance(conn, attempts=3, retry_delay=1.0)
    assert delays == [1.0], delays
    first = [s for s in steps if s.attempt == 1 and s.partition_name == name]
    second = [s for s in steps if s.attempt == 2 and s.partition_name == name]
    assert first and first[0].skipped_for_a_lock, steps
    assert second and second[0].action == "dropped", steps
    assert max(s.attempt for s in steps) == 2
    assert "attempt" in maintenance.format_report(steps).splitlines()[0]


def test_python_status(db: str) -> None:
    with psycopg.connect(db, autocommit=True) as conn:
        name = old_partition_with_a_key(conn, 5, "old")
        conn.execute(CLAIM, ("st", "stuck", Jsonb({}), datetime.now().astimezone()
                             - timedelta(minutes=5)))
        status = maintenance.fetch_status(conn)
    by_state = {(k["scope"], k["state"]): k for k in status.keys}
    assert by_state[("st", "in_progress")]["expired_leases"] == 1
    assert by_state[("st", "in_progress")]["oldest_key"] == "stuck"
    assert by_state[("mt", "completed")]["keys"] == 1
    parts = {p["partition_name"]: p for p in status.partitions}
    assert parts[name]["row_count"] == 1 and parts[name]["note"] == "due"
    assert parts["keys_default"]["note"] == "default"
    assert status.next_drop is not None and status.next_drop["partition_name"] in (
        name, name.replace("keys_", "inbox_"))
    text = maintenance.format_status(status)
    assert "stuck" in text and name in text and text.splitlines()[-1].startswith("next drop: ")


def test_the_python_api_surfaces_an_expired_key(db: str) -> None:
    """A key dropped after its retention with tombstones on: claim() returns outcome
    expired (not dropped, not a fresh claim), operation() raises KeyExpired, sync and async."""
    import asyncio

    import pg_idempotency as idem
    from pg_idempotency import aio

    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute("UPDATE idempotency.settings SET tombstones = true")
        name = old_partition_with_a_key(conn, 5, "gone")
        steps = conn.execute(MAINTAIN, (datetime.now().astimezone(),)).fetchall()
        assert ("dropped", "keys", name, 1) in [s[:4] for s in steps], steps
        result = idem.claim(conn, "mt", "gone", {"k": "gone"})
        assert result.outcome is idem.Outcome.EXPIRED and not result.outcome.owned
        assert result.lease_token is None and result.response is None
        with pytest.raises(idem.KeyExpired, match="expired"):
            with idem.operation(conn, "mt", "gone", {"k": "gone"}):
                pytest.fail("an expired key must never execute")

    async def async_side() -> None:
        async with await psycopg.AsyncConnection.connect(db, autocommit=True) as aconn:
            assert (await aio.claim(aconn, "mt", "gone", {"k": "gone"})).outcome == "expired"
            with pytest.raises(idem.KeyExpired):
                async with aio.operation(aconn, "mt", "gone", {"k": "gone"}):
                    pytest.fail("an expired key must never execute")

    asyncio.run(async_side())
    with psycopg.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM idempotency.keys WHERE key = 'gone'"
                            ).fetchone()[0] == 0


# -- status and metrics agree with maintain() about the newest rows ------------------------------


def test_status_and_metrics_do_not_call_due_what_maintain_keeps(db: str) -> None:
    """An idle system: the only key is 5 days old. maintain() keeps its partition (it holds the
    newest rows); partition_status() says 'kept' (no drop_after, never 'due') and metrics()'s
    next drop is not overdue. Once a newer key exists, all three agree that it goes."""
    with psycopg.connect(db, autocommit=True) as conn:
        lo = day_start(conn, -5)
        conn.execute("SELECT idempotency._create_partition('keys', %s, %s)",
                     (lo, lo + timedelta(days=1)))
        conn.execute(CLAIM, ("mt", "idle", Jsonb({}), lo + timedelta(hours=1)))
        name = conn.execute("SELECT tableoid::regclass::text FROM idempotency.keys "
                            "WHERE key = 'idle'").fetchone()[0].removeprefix("idempotency.")

        def status() -> tuple[Any, Any]:
            return conn.execute(
                "SELECT note, drop_after FROM idempotency.partition_status() "
                "WHERE partition_name = %s", (name,)).fetchone()

        def next_drop() -> float:
            return conn.execute(
                "SELECT next_drop_seconds FROM idempotency.metrics(scan => false)").fetchone()[0]

        assert status() == ("kept", None)
        assert next_drop() > 0  # today's partition, a day after it ends
        steps = conn.execute(MAINTAIN, (datetime.now().astimezone(),)).fetchall()
        assert [(s[0], s[4]) for s in steps if s[2] == name] == [
            ("skipped", "never dropped: it holds the newest rows, or comes after them")], steps
        assert exists(conn, name)

        # A newer key: the old partition is due, overdue in metrics, and the next run drops it.
        conn.execute("SELECT idempotency.claim('mt', 'fresh', '{}')")
        note, drop_after = status()
        assert note == "due" and drop_after == lo + timedelta(days=2), (note, drop_after)
        assert next_drop() == pytest.approx(
            (drop_after - datetime.now().astimezone()).total_seconds(), abs=60)
        assert next_drop() < 0
        steps = conn.execute(MAINTAIN, (datetime.now().astimezone(),)).fetchall()
        assert ("dropped", "keys", name, 1) in [s[:4] for s in steps], steps
        assert not exists(conn, name)
        assert next_drop() > 0
