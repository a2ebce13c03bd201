"""Real concurrent sessions against claim(), complete(), takeover() and inbox_accept().

Every session is a thread with its own psycopg connection; sessions connect first and then
start together at a barrier, so the calls really overlap on the server.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any, TypeVar

import psycopg
import pytest
from psycopg import IsolationLevel
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from pgharness import WAIT_BOUND

T = TypeVar("T")

CLAIM_SQL = """
SELECT outcome, lease_token, response_status, response_headers, response_body,
       created_at, completed_at
FROM idempotency.claim(scope => %s, key => %s, request => %s::jsonb,
                       lease => %s::interval, reference_time => %s::timestamptz)
"""

KEY_PARTITIONS_SQL = """
SELECT c.oid::regclass::text AS name,
       b.m[1]::timestamptz AS lower_bound,
       b.m[2]::timestamptz AS upper_bound
FROM pg_inherits AS i
JOIN pg_class AS c ON c.oid = i.inhrelid
CROSS JOIN LATERAL (
    SELECT regexp_match(pg_get_expr(c.relpartbound, c.oid),
                        $re$FROM \\('([^']+)'\\) TO \\('([^']+)'\\)$re$) AS m
) AS b
WHERE i.inhparent = %s::regclass AND b.m IS NOT NULL
ORDER BY 2
"""


def run_sessions(
    dsn: str,
    n: int,
    work: Callable[[int, psycopg.Connection[Any]], T],
    *,
    autocommit: bool = True,
) -> list[T]:
    """Run ``work(i, conn)`` in ``n`` threads, each on its own connection, all released at
    once by a barrier. Returns the results in session order; re-raises the first error."""
    barrier = threading.Barrier(n, timeout=WAIT_BOUND)
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def session(i: int) -> None:
        try:
            with psycopg.connect(dsn, autocommit=autocommit) as conn:
                barrier.wait()
                results[i] = work(i, conn)
        except BaseException as exc:  # reported below, whichever session failed
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=session, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + WAIT_BOUND  # one bound for all: they run at once
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        pytest.fail(f"a session did not finish within {WAIT_BOUND:.0f} s")
    if errors:
        real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
        raise (real or errors)[0]
    return results


def key_partitions(conn: psycopg.Connection[Any], parent: str) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(KEY_PARTITIONS_SQL, (parent,)).fetchall()


def boundary_of_current_partition(
    conn: psycopg.Connection[Any], parent: str
) -> tuple[datetime, str, str]:
    """The upper bound of the partition holding now(), which the next partition starts at:
    (boundary, partition before it, partition after it)."""
    parts = key_partitions(conn, parent)
    now = conn.execute("SELECT now()").fetchone()[0]
    for before, after in zip(parts, parts[1:], strict=False):
        if before["lower_bound"] <= now < before["upper_bound"]:
            assert after["lower_bound"] == before["upper_bound"], parts
            return before["upper_bound"], before["name"], after["name"]
    raise AssertionError(f"no pair of adjacent partitions around now() = {now}: {parts}")


def rows_per_partition(conn: psycopg.Connection[Any], table: str, where: str = "true"
                       ) -> Counter[str]:
    rows = conn.execute(
        f"SELECT tableoid::regclass::text, count(*) FROM {table} WHERE {where} GROUP BY 1"
    ).fetchall()
    return Counter(dict(rows))


def expect_sqlstate(conn: psycopg.Connection[Any], query: str, params: Sequence[Any],
                    sqlstate: str) -> psycopg.Error:
    with pytest.raises(psycopg.Error) as info:
        conn.execute(query, params)
    assert info.value.sqlstate == sqlstate, (info.value.sqlstate, str(info.value))
    return info.value


def wait_until_blocked(observer: psycopg.Connection[Any], thread: threading.Thread,
                       waiter: psycopg.Connection[Any], what: str) -> None:
    """Wait until ``waiter``'s backend waits on a heavyweight lock (advisory, row or
    transaction lock); fail if ``thread`` finishes first: it should not have got through."""
    pid = waiter.info.backend_pid
    deadline = time.monotonic() + WAIT_BOUND
    while time.monotonic() < deadline:
        if not thread.is_alive():
            pytest.fail(f"{what} did not wait for the open transaction")
        waiting = observer.execute(
            "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s", (pid,)
        ).fetchone()
        if waiting and waiting[0]:
            return
        time.sleep(0.01)
    pytest.fail(f"{what} neither finished nor waited on a lock within {WAIT_BOUND:.0f} s")


# -- 64 sessions x 200 keys, straddling a partition boundary ---------------------------------


SESSIONS = 64
KEYS = 200


def test_every_key_claimed_exactly_once_across_a_partition_boundary(db: str) -> None:
    with psycopg.connect(db, autocommit=True) as conn:
        boundary, before, after = boundary_of_current_partition(conn, "idempotency.keys")

    request = {"amount": 100, "currency": "EUR"}
    keys = [f"k{i:03d}" for i in range(KEYS)]

    def reference_time(session: int, key_index: int) -> datetime:
        # Half the claims a little before midnight, half a little after, and every key is
        # claimed from both sides, so whichever claim wins, the losers look it up from the
        # other partition's side of the boundary.
        jitter = timedelta(microseconds=1000 + (session * 7919 + key_index * 104729) % 500_000)
        return boundary - jitter if (session + key_index) % 2 == 0 else boundary + jitter

    def work(session: int, conn: psycopg.Connection[Any]) -> list[tuple[str, str, int | None]]:
        order = list(range(KEYS))
        random.Random(session).shuffle(order)
        out = []
        with conn.cursor() as cur:
            for k in order:
                cur.execute(CLAIM_SQL, ("conc", keys[k], Jsonb(request), "5 minutes",
                                        reference_time(session, k)), prepare=True)
                outcome, token, *_ = cur.fetchone()
                out.append((keys[k], outcome, token))
        return out

    results = run_sessions(db, SESSIONS, work)

    per_key: dict[str, Counter[str]] = {k: Counter() for k in keys}
    tokens = []
    for session_results in results:
        assert len(session_results) == KEYS
        for key, outcome, token in session_results:
            per_key[key][outcome] += 1
            if outcome == "claimed":
                tokens.append(token)
            else:
                assert token is None, "a non-owner must never see the owner's lease token"
    bad = {k: dict(c) for k, c in per_key.items()
           if c != Counter({"claimed": 1, "in_progress": SESSIONS - 1})}
    assert not bad, (f"{len(bad)} keys without exactly one claimed and {SESSIONS - 1} "
                     f"in_progress, e.g. {dict(list(bad.items())[:5])}")
    assert len(set(tokens)) == KEYS, "every claim must get its own fencing token"

    with psycopg.connect(db, autocommit=True) as conn:
        total, distinct = conn.execute(
            "SELECT count(*), count(DISTINCT (scope, key)) FROM idempotency.keys"
        ).fetchone()
        assert (total, distinct) == (KEYS, KEYS)
        # Exactly one row per key across all partitions, each with the winner's token.
        stored = dict(conn.execute(
            "SELECT key, lease_token FROM idempotency.keys WHERE scope = 'conc'"
        ).fetchall())
        assert sorted(stored.values()) == sorted(tokens)
        per_part = rows_per_partition(conn, "idempotency.keys")
        assert per_part[before] > 0 and per_part[after] > 0, (
            f"rows should land on both sides of {boundary}: {dict(per_part)}")
        assert per_part[before] + per_part[after] == KEYS, dict(per_part)
        assert per_part["idempotency.keys_default"] == 0
        # Each row sits in the partition its winning claim's reference_time selects.
        misplaced = conn.execute(
            "SELECT count(*) FROM idempotency.keys WHERE (created_at < %s) <> "
            "(tableoid = %s::regclass)", (boundary, before)
        ).fetchone()[0]
        assert misplaced == 0


# -- retries after (and racing with) completion -----------------------------------------------


def test_concurrent_retries_after_completion_replay_identically(db: str) -> None:
    request = {"to": "acct-9", "amount": 12.5}
    body = {"payment_id": "pay_1", "amount": 12.5, "nested": {"b": [1, 2, 3], "a": None}}
    headers = {"Location": "/payments/pay_1", "X-Request-Id": "r-1"}
    with psycopg.connect(db, autocommit=True) as conn:
        token = conn.execute(CLAIM_SQL, ("replay", "r1", Jsonb(request), "5 minutes", None)
                             ).fetchone()[1]
        assert token is not None
        conn.execute("SELECT idempotency.complete('replay', 'r1', %s, 201, %s, %s)",
                     (token, Jsonb(body), Jsonb(headers)))
        stored = conn.execute(
            "SELECT created_at, completed_at FROM idempotency.keys WHERE key = 'r1'"
        ).fetchone()

    n = 32

    def work(_: int, conn: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
        return [conn.execute(CLAIM_SQL, ("replay", "r1", Jsonb(request), "5 minutes", None)
                             ).fetchone() for _ in range(5)]

    results = [r for rs in run_sessions(db, n, work) for r in rs]
    assert len(results) == n * 5
    expected = ("replay", None, 201, headers, body, stored[0], stored[1])
    assert all(r == expected for r in results), Counter(results).most_common(3)


def test_retries_racing_the_completion_see_in_progress_then_one_identical_replay(
    db: str,
) -> None:
    request = {"sku": "A-1", "qty": 3}
    body = {"order": 77, "total": 30.0}
    with psycopg.connect(db, autocommit=True) as conn:
        token = conn.execute(CLAIM_SQL, ("race", "r2", Jsonb(request), "5 minutes", None)
                             ).fetchone()[1]
        conn.execute("CREATE TABLE orders (id integer)")

    n = 16
    outcomes: list[list[tuple[Any, ...]]] = [[] for _ in range(n)]
    retried = threading.Event()  # a retry has seen in_progress: the owner may finish

    def work(i: int, conn: psycopg.Connection[Any]) -> None:
        if i == 0:  # the owner: finish the business transaction while retries hammer away
            assert retried.wait(WAIT_BOUND), "no retry ran while the key was in progress"
            with conn.transaction():
                conn.execute("INSERT INTO orders VALUES (77)")
                conn.execute("SELECT idempotency.complete('race', 'r2', %s, 200, %s)",
                             (token, Jsonb(body)))
            return
        deadline = time.monotonic() + WAIT_BOUND
        while time.monotonic() < deadline:
            row = conn.execute(CLAIM_SQL, ("race", "r2", Jsonb(request), "5 minutes", None)
                               ).fetchone()
            outcomes[i].append(row)
            if row[0] == "in_progress":
                retried.set()
            if row[0] == "replay":
                return
        raise AssertionError(f"session {i} never saw the replay")

    run_sessions(db, n, work)
    seen = Counter(row[0] for rows in outcomes for row in rows)
    assert set(seen) <= {"in_progress", "replay"}, seen
    assert seen["replay"] == n - 1
    assert seen["in_progress"] > 0, "the retries should have overlapped the owner's work"
    replays = {tuple(map(repr, rows[-1])) for rows in outcomes[1:]}
    assert len(replays) == 1, replays
    assert outcomes[1][-1][2:5] == (200, {}, body)
    with psycopg.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM orders").fetchone()[0] == 1


# -- takeover race and fencing ------------------------------------------------------------------


def test_takeover_race_has_one_winner_and_the_old_token_is_fenced(db: str) -> None:
    request = {"job": "export", "id": 5}
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute("CREATE TABLE ledger (ref text NOT NULL, amount numeric NOT NULL)")
        conn.execute("GRANT ALL ON ledger TO public")
        # A claim whose 1-second lease ran out a minute ago (its worker crashed).
        old = conn.execute(
            CLAIM_SQL, ("takeover", "t1", Jsonb(request), "1 second",
                        conn.execute("SELECT clock_timestamp() - interval '1 minute'"
                                     ).fetchone()[0])
        ).fetchone()
        assert old[0] == "claimed"
        old_token = old[1]

    n = 24

    def work(i: int, conn: psycopg.Connection[Any]) -> tuple[str, int | None]:
        # Retries through claim() and background completers through takeover() at once.
        if i % 2 == 0:
            row = conn.execute(CLAIM_SQL, ("takeover", "t1", Jsonb(request), "5 minutes", None)
                               ).fetchone()
        else:
            row = conn.execute(
                "SELECT outcome, lease_token FROM idempotency.takeover('takeover', 't1', "
                "'5 minutes')").fetchone()
        return row[0], row[1]

    results = run_sessions(db, n, work)
    outcomes = Counter(o for o, _ in results)
    assert outcomes == Counter({"resumed": 1, "in_progress": n - 1}), outcomes
    new_token = next(t for o, t in results if o == "resumed")
    assert new_token > old_token
    assert all(t is None for o, t in results if o == "in_progress")

    with psycopg.connect(db) as old_owner, psycopg.connect(db) as new_owner:
        # The old worker wakes up and finishes: its ledger write must not survive.
        with pytest.raises(psycopg.Error) as info:
            with old_owner.transaction():
                old_owner.execute("INSERT INTO ledger VALUES ('t1', 10)")
                old_owner.execute("SELECT idempotency.complete('takeover', 't1', %s, 200, "
                                  "'{\"by\": \"old\"}')", (old_token,))
        assert info.value.sqlstate == "IK001", str(info.value)
        assert old_owner.execute("SELECT count(*) FROM ledger").fetchone()[0] == 0
        old_owner.rollback()

        with new_owner.transaction():
            new_owner.execute("INSERT INTO ledger VALUES ('t1', 10)")
            new_owner.execute("SELECT idempotency.complete('takeover', 't1', %s, 200, "
                              "'{\"by\": \"new\"}')", (new_token,))
        assert new_owner.execute("SELECT count(*) FROM ledger").fetchone()[0] == 1
        new_owner.commit()

    with psycopg.connect(db, autocommit=True) as conn:
        row = conn.execute(CLAIM_SQL, ("takeover", "t1", Jsonb(request), "5 minutes", None)
                           ).fetchone()
        assert row[0] == "replay" and row[4] == {"by": "new"}
        state = conn.execute("SELECT state, lease_token, attempts FROM idempotency.keys "
                             "WHERE key = 't1'").fetchone()
        assert state == ("completed", new_token, 2)


def test_old_owner_completing_during_a_takeover_is_fenced(db: str) -> None:
    """The old owner's complete() and a takeover overlap: exactly one of them wins."""
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute("CREATE TABLE ledger (ref text NOT NULL)")
        past = conn.execute("SELECT clock_timestamp() - interval '1 minute'").fetchone()[0]
        old_token = conn.execute(CLAIM_SQL, ("fence", "f1", Jsonb({"x": 1}), "1 second", past)
                                 ).fetchone()[1]

    with psycopg.connect(db) as old_owner, psycopg.connect(db, autocommit=True) as retry, \
            psycopg.connect(db, autocommit=True) as observer:
        # The old owner completes but has not committed yet: its row lock holds the takeover.
        old_owner.execute("INSERT INTO ledger VALUES ('old')")
        old_owner.execute("SELECT idempotency.complete('fence', 'f1', %s, 200, '{}')",
                          (old_token,))
        box: dict[str, Any] = {}

        def retry_claim() -> None:
            box["row"] = retry.execute(CLAIM_SQL, ("fence", "f1", Jsonb({"x": 1}), "5 minutes",
                                                   None)).fetchone()

        t = threading.Thread(target=retry_claim, daemon=True)
        t.start()
        wait_until_blocked(observer, t, retry, "the takeover by a retry")
        old_owner.commit()
        t.join(WAIT_BOUND)
        assert not t.is_alive()
        assert box["row"][0] == "replay", box["row"]

    with psycopg.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM ledger").fetchone()[0] == 1


# -- inbox_accept -----------------------------------------------------------------------------


def test_inbox_accept_one_winner_per_message(db: str) -> None:
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute("CREATE TABLE effects (message_id text NOT NULL, session integer)")
        boundary, before, after = boundary_of_current_partition(conn, "idempotency.inbox")

    n, messages = 32, [f"m{i:02d}" for i in range(50)]

    def work(session: int, conn: psycopg.Connection[Any]) -> list[tuple[str, bool]]:
        order = list(range(len(messages)))
        random.Random(1000 + session).shuffle(order)
        out = []
        for m in order:
            received = boundary + timedelta(milliseconds=-5 if (m + session) % 2 else 5)
            with conn.transaction():
                accepted = conn.execute(
                    "SELECT idempotency.inbox_accept('billing', %s, %s)",
                    (messages[m], received), prepare=True).fetchone()[0]
                if accepted:
                    conn.execute("INSERT INTO effects VALUES (%s, %s)", (messages[m], session))
            out.append((messages[m], accepted))
        return out

    results = run_sessions(db, n, work, autocommit=False)
    trues = Counter(m for rs in results for m, ok in rs if ok)
    falses = Counter(m for rs in results for m, ok in rs if not ok)
    assert trues == Counter({m: 1 for m in messages}), trues
    assert falses == Counter({m: n - 1 for m in messages})
    with psycopg.connect(db, autocommit=True) as conn:
        assert conn.execute("SELECT count(*), count(DISTINCT message_id) FROM effects"
                            ).fetchone() == (50, 50)
        assert conn.execute("SELECT count(*) FROM idempotency.inbox").fetchone()[0] == 50
        per_part = rows_per_partition(conn, "idempotency.inbox")
        assert per_part[before] > 0 and per_part[after] > 0, dict(per_part)
        assert per_part["idempotency.inbox_default"] == 0


def test_inbox_accept_rolled_back_delivery_lets_the_waiting_one_through(db: str) -> None:
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute("CREATE TABLE effects (message_id text NOT NULL, session text)")

    accept = "SELECT idempotency.inbox_accept('billing', 'm-rb')"
    with psycopg.connect(db) as first, psycopg.connect(db) as second, \
            psycopg.connect(db, autocommit=True) as observer:
        assert first.execute(accept).fetchone()[0] is True
        first.execute("INSERT INTO effects VALUES ('m-rb', 'first')")
        box: dict[str, Any] = {}

        def redelivery() -> None:
            box["accepted"] = second.execute(accept).fetchone()[0]
            if box["accepted"]:
                second.execute("INSERT INTO effects VALUES ('m-rb', 'second')")
            second.commit()

        t = threading.Thread(target=redelivery, daemon=True)
        t.start()
        wait_until_blocked(observer, t, second, "a concurrent delivery")
        first.rollback()  # the first consumer crashed before committing its effects
        t.join(WAIT_BOUND)
        assert not t.is_alive()
        assert box["accepted"] is True

    with psycopg.connect(db, autocommit=True) as conn:
        assert conn.execute(accept).fetchone()[0] is False  # a later redelivery
        assert conn.execute("SELECT message_id, session FROM effects").fetchall() == [
            ("m-rb", "second")]
        assert conn.execute("SELECT count(*) FROM idempotency.inbox").fetchone()[0] == 1


def test_uncommitted_claim_blocks_a_concurrent_claim_until_it_ends(db: str) -> None:
    """A claim inside a READ COMMITTED transaction: the other claim waits on the key lock and
    sees the outcome (in_progress after commit, claimed after rollback)."""
    results: dict[str, Any] = {}
    for ending in ("commit", "rollback"):
        key = f"u-{ending}"
        with psycopg.connect(db) as first, psycopg.connect(db, autocommit=True) as second, \
                psycopg.connect(db, autocommit=True) as observer:
            assert first.execute(CLAIM_SQL, ("unc", key, Jsonb({}), "5 minutes", None)
                                 ).fetchone()[0] == "claimed"

            def other(key: str = key, ending: str = ending) -> None:
                results[ending] = second.execute(
                    CLAIM_SQL, ("unc", key, Jsonb({}), "5 minutes", None)).fetchone()[0]

            t = threading.Thread(target=other, daemon=True)
            t.start()
            wait_until_blocked(observer, t, second, "the second claim")
            getattr(first, ending)()
            t.join(WAIT_BOUND)
            assert not t.is_alive()
    assert results == {"commit": "in_progress", "rollback": "claimed"}
    with psycopg.connect(db) as conn:
        assert conn.execute("SELECT key, count(*) FROM idempotency.keys GROUP BY 1 ORDER BY 1"
                            ).fetchall() == [("u-commit", 1), ("u-rollback", 1)]


# -- isolation levels ---------------------------------------------------------------------------


@pytest.mark.parametrize("level", [IsolationLevel.REPEATABLE_READ, IsolationLevel.SERIALIZABLE],
                         ids=["repeatable_read", "serializable"])
@pytest.mark.parametrize("call", [
    "SELECT * FROM idempotency.claim('iso', 'k', '{}'::jsonb)",
    "SELECT idempotency.inbox_accept('iso', 'm')",
], ids=["claim", "inbox_accept"])
def test_claim_and_inbox_accept_refuse_snapshot_isolation(
    db: str, level: IsolationLevel, call: str
) -> None:
    with psycopg.connect(db) as conn:
        conn.isolation_level = level
        err = expect_sqlstate(conn, call, (), "IK005")
        assert "READ COMMITTED" in str(err)
        conn.rollback()
        # Also when it is not the transaction's first statement.
        conn.execute("SELECT 1")
        expect_sqlstate(conn, call, (), "IK005")
        conn.rollback()
    with psycopg.connect(db, autocommit=True) as conn:
        assert conn.execute("SELECT (SELECT count(*) FROM idempotency.keys) + "
                            "(SELECT count(*) FROM idempotency.inbox)").fetchone()[0] == 0


def test_complete_under_repeatable_read(db: str) -> None:
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute("CREATE TABLE ledger (ref text NOT NULL)")
        token = conn.execute(CLAIM_SQL, ("rr", "k1", Jsonb({"a": 1}), "5 minutes", None)
                             ).fetchone()[1]
        past = conn.execute("SELECT clock_timestamp() - interval '1 minute'").fetchone()[0]
        stale = conn.execute(CLAIM_SQL, ("rr", "k2", Jsonb({"a": 2}), "1 second", past)
                             ).fetchone()[1]

    with psycopg.connect(db) as conn:
        conn.isolation_level = IsolationLevel.REPEATABLE_READ
        with conn.transaction():
            conn.execute("INSERT INTO ledger VALUES ('k1')")
            conn.execute("SELECT idempotency.complete('rr', 'k1', %s, 200, '{\"ok\": true}')",
                         (token,))

        # Contended: a takeover commits after this transaction's snapshot was taken. The
        # stale completion must not commit, whichever error says so.
        with psycopg.connect(db, autocommit=True) as other:
            conn.execute("SELECT 1")  # take the snapshot
            assert other.execute(CLAIM_SQL, ("rr", "k2", Jsonb({"a": 2}), "5 minutes", None)
                                 ).fetchone()[0] == "resumed"
            conn.execute("INSERT INTO ledger VALUES ('k2')")
            with pytest.raises(psycopg.Error) as info:
                conn.execute("SELECT idempotency.complete('rr', 'k2', %s, 200, '{}')", (stale,))
            assert info.value.sqlstate in {"40001", "IK001"}, str(info.value)
            conn.rollback()

    with psycopg.connect(db, autocommit=True) as conn:
        assert conn.execute("SELECT ref FROM ledger").fetchall() == [("k1",)]
        assert conn.execute(CLAIM_SQL, ("rr", "k1", Jsonb({"a": 1}), "5 minutes", None)
                            ).fetchone()[0:5:4] == ("replay", {"ok": True})
        assert conn.execute("SELECT state FROM idempotency.keys WHERE key = 'k2'"
                            ).fetchone()[0] == "in_progress"
