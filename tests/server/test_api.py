"""The Python API on real PostgreSQL 15 and 18: every outcome through the sync and the async
flavour, the operation() flow's transactions, the exception classes, psycopg_pool.

Each scenario is written once as a coroutine and run with both flavours: ``call`` awaits what
the async API returns and passes the sync API's results through.
"""

from __future__ import annotations

import inspect
import os
import re
import tempfile
from datetime import datetime, timedelta, timezone
from typing import Any

import asyncpg
import psycopg
import pytest
from helpers.api import _enter, call, execute, idle, is_asyncpg, rollback
from psycopg_pool import AsyncConnectionPool, ConnectionPool

import pg_idempotency as idem
from pg_idempotency import aio, errors
from pg_idempotency.fingerprint import MAX_REQUEST_BYTES

pytestmark = pytest.mark.anyio

LEDGER = "CREATE TABLE ledger (id serial PRIMARY KEY, account text, amount integer)"


@pytest.fixture(params=["sync", "async", "asyncpg"])
async def flavour(request: pytest.FixtureRequest, db: str) -> Any:
    """(api module, connection) for the sync or the async API (on psycopg, or on asyncpg),
    with a ledger table."""
    with psycopg.connect(db, autocommit=True) as setup:
        setup.execute(LEDGER)
    if request.param == "sync":
        with psycopg.connect(db, autocommit=True) as conn:
            yield idem, conn
    elif request.param == "asyncpg":
        conn = await asyncpg.connect(db)
        try:
            yield aio, conn
        finally:
            await conn.close()
    else:
        async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
            yield aio, conn


def ledger_count(db: str) -> int:
    with psycopg.connect(db) as conn:
        return conn.execute("SELECT count(*) FROM ledger").fetchone()[0]


def key_row(db: str, key: str) -> tuple[Any, ...] | None:
    with psycopg.connect(db) as conn:
        return conn.execute(
            "SELECT state, recovery_point, attempts FROM idempotency.keys WHERE key = %s",
            (key,)).fetchone()


def released_token(db: str, key: str) -> int:
    """The lease token of a key that release() left in state released (no lease, no response,
    its directory row kept); fails if the key is in any other state."""
    with psycopg.connect(db) as conn:
        row = conn.execute(
            "SELECT k.state, k.lease_expires_at, k.response_status, k.response_body,"
            "       k.lease_token, d.created_at = k.created_at"
            " FROM idempotency.keys AS k"
            " LEFT JOIN idempotency.key_directory AS d"
            "   ON d.scope = k.scope AND d.key_hash = sha256(convert_to(k.key, 'UTF8'))"
            " WHERE k.key = %s", (key,)).fetchone()
    assert row is not None and row[:4] == ("released", None, None, None) and row[5] is True, row
    return row[4]


def assert_same_lease_lost(a: errors.LeaseLost, b: errors.LeaseLost) -> None:
    """Two IK001 answers that tell nothing apart: same class, SQLSTATE, DETAIL and HINT, and the
    same message once the token and the key it names are taken out."""
    assert type(a) is type(b) is errors.LeaseLost and a.sqlstate == b.sqlstate == "IK001"
    assert a.detail == b.detail and a.hint == b.hint and a.detail and a.hint

    def shape(e: errors.LeaseLost) -> str:
        return re.sub(r'^idempotency\.\w+: lease token \d+ is not the current one for key ".*" in ',
                      "F: lease token T is not the current one for key K in ", str(e))

    assert shape(a) == shape(b), (str(a), str(b))
    assert shape(a).startswith("F: lease token T is not the current one for key K in scope ")


async def insert(conn: Any, amount: int) -> None:
    await execute(conn, "INSERT INTO ledger (account, amount) VALUES ('a', %s)", amount)


async def test_every_outcome(flavour: Any, db: str) -> None:
    api, conn = flavour
    t0 = datetime.now(timezone.utc)
    req = {"amount": 50, "currency": "EUR"}

    first = await call(api.claim(conn, "acct", "k1", req, lease=10, reference_time=t0))
    assert first.outcome is idem.Outcome.CLAIMED and first.outcome.owned
    assert first.lease_token > 0 and first.attempts == 1 and first.response is None

    busy = await call(api.claim(conn, "acct", "k1", req, reference_time=t0 + timedelta(seconds=4)))
    assert busy.outcome is idem.Outcome.IN_PROGRESS and busy.lease_token is None
    assert busy.retry_after == timedelta(seconds=6)

    other = await call(api.claim(conn, "acct", "k1", {"amount": 51}, reference_time=t0))
    assert other.outcome is idem.Outcome.MISMATCH
    with pytest.raises(errors.KeyMismatch) as mismatch:
        await call(api.claim(conn, "acct", "k1", {"amount": 51}, strict=True, reference_time=t0))
    assert mismatch.value.sqlstate == "IK002" and mismatch.value.detail

    # the lease expires: the next claim resumes from the recovery point, with a higher token
    later = t0 + timedelta(seconds=11)
    await call(api.checkpoint(conn, "acct", "k1", first.lease_token, "charge_created",
                              reference_time=t0))
    resumed = await call(api.claim(conn, "acct", "k1", req, reference_time=later))
    assert resumed.outcome is idem.Outcome.RESUMED
    assert resumed.recovery_point == "charge_created" and resumed.attempts == 2
    assert resumed.lease_token > first.lease_token

    # the stale holder is fenced off
    with pytest.raises(errors.LeaseLost) as lost:
        await call(api.complete(conn, "acct", "k1", first.lease_token, 201, {"id": 1},
                                reference_time=later))
    assert lost.value.sqlstate == "IK001"

    await call(api.heartbeat(conn, "acct", "k1", resumed.lease_token, lease=20,
                             reference_time=later))
    done = await call(api.complete(conn, "acct", "k1", resumed.lease_token, 201, {"id": 1},
                                   headers={"Location": "/charges/1"}, reference_time=later))
    assert isinstance(done, datetime)

    replay = await call(api.claim(conn, "acct", "k1", req, reference_time=later))
    assert replay.outcome is idem.Outcome.REPLAY and not replay.outcome.owned
    assert replay.response == idem.StoredResponse(
        status=201, headers={"Location": "/charges/1"}, body={"id": 1}, body_bytes=b'{"id":1}',
        content_type="application/json", completed_at=done)
    assert replay.response.content == b'{"id":1}'

    # only the owner's own token is told that the key is completed (IK004)...
    with pytest.raises(errors.AlreadyCompleted) as own:
        await call(api.release(conn, "acct", "k1", resumed.lease_token))
    assert isinstance(own.value, errors.LeaseLostCompleted) and own.value.sqlstate == "IK004"
    # ...any other token gets the same IK001 for a completed key and for one never claimed
    with pytest.raises(errors.LeaseLost) as on_completed:
        await call(api.release(conn, "acct", "k1", first.lease_token))
    with pytest.raises(errors.LeaseLost) as on_absent:
        await call(api.release(conn, "acct", "nope", first.lease_token))
    assert_same_lease_lost(on_completed.value, on_absent.value)
    assert_same_lease_lost(on_completed.value, lost.value)  # and for one taken over

    # bytes bodies keep their exact bytes and content type; a released key starts afresh,
    # under a token greater than the released owner's
    b1 = await call(api.claim(conn, "acct", "k2", None, fingerprint=b"\x01" * 32))
    await call(api.release(conn, "acct", "k2", b1.lease_token))
    assert released_token(db, "k2") == b1.lease_token
    b = await call(api.claim(conn, "acct", "k2", None, fingerprint=b"\x02" * 32))
    assert b.outcome is idem.Outcome.CLAIMED and b.attempts == 1
    assert b.lease_token > b1.lease_token
    await call(api.complete(conn, "acct", "k2", b.lease_token, 200, b"<p>hi</p>",
                            content_type="text/html"))
    again = await call(api.claim(conn, "acct", "k2", None, fingerprint=b"\x02" * 32))
    assert again.response.body_bytes == b"<p>hi</p>"
    assert again.response.content_type == "text/html" and again.response.body is None


async def test_takeover_list_abandoned_inbox(flavour: Any) -> None:
    api, conn = flavour
    t0 = datetime.now(timezone.utc)
    for k in ("a1", "a2"):
        await call(api.claim(conn, "s", k, {"k": k}, lease=1, reference_time=t0))
    later = t0 + timedelta(seconds=5)
    await call(conn.execute("BEGIN"))
    abandoned = await call(api.list_abandoned(conn, 10, scope="s", reference_time=later))
    assert sorted(a.key for a in abandoned) == ["a1", "a2"]
    assert all(isinstance(a, idem.AbandonedKey) and a.attempts == 1 for a in abandoned)
    taken = await call(api.takeover(conn, "s", "a1", reference_time=later))
    await call(conn.execute("COMMIT"))
    assert taken.outcome is idem.Outcome.RESUMED
    assert await call(api.inbox_accept(conn, "worker", "m1")) is True
    assert await call(api.inbox_accept(conn, "worker", "m1")) is False


async def test_argument_errors(flavour: Any) -> None:
    api, conn = flavour
    cases = [
        (errors.ArgumentNull, "IK010", "key", dict(scope="s", key=None, request={})),
        (errors.ArgumentEmpty, "IK011", "scope", dict(scope="", key="k", request={})),
        (errors.ArgumentTooLong, "IK012", "key", dict(scope="s", key="k" * 256, request={})),
        (errors.ArgumentInvalidCharacters, "IK013", "key",
         dict(scope="s", key="a\nb", request={})),
        (errors.ArgumentOutOfRange, "IK014", "lease",
         dict(scope="s", key="k", request={}, lease=0)),
        (errors.ArgumentConflict, "IK016", "fingerprint",
         dict(scope="s", key="k", request={}, fingerprint=b"x" * 32)),
        # The test clock must be finite and far from overflow (the owner may pass it; an
        # application role gets IK017, ArgumentNotAllowed: tests/sql/45_clock.sql).
        (errors.ArgumentOutOfRange, "IK014", "reference_time",
         dict(scope="s", key="k", request={},
              reference_time=datetime(9999, 6, 1, tzinfo=timezone.utc))),
    ]
    for cls, state, argument, kwargs in cases:
        with pytest.raises(cls) as info:
            await call(api.claim(conn, **kwargs))
        e = info.value
        assert isinstance(e, errors.InvalidArgument) and isinstance(e, ValueError)
        assert (e.sqlstate, e.argument, e.function) == (state, argument, "idempotency.claim")
        driver_error = asyncpg.PostgresError if is_asyncpg(conn) else psycopg.Error
        assert isinstance(e.__cause__, driver_error) and e.pgerror is e.__cause__
    c = await call(api.claim(conn, "s", "k", {}))
    with pytest.raises(errors.ArgumentWrongType) as info:
        await call(api.complete(conn, "s", "k", c.lease_token, 200, None,
                                headers={"Bad Header": "x"}))
    assert info.value.sqlstate == "IK015"
    with pytest.raises(errors.IsolationNotSupported) as iso:
        await call(conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ"))
        await call(api.claim(conn, "s", "k9", {}))
    assert iso.value.sqlstate == "IK005"
    await rollback(conn)
    # an error PostgreSQL raises itself is not translated
    with pytest.raises(asyncpg.UntranslatableCharacterError if is_asyncpg(conn)
                       else psycopg.errors.UntranslatableCharacter):
        await call(conn.execute("""SELECT '"\\u0000"'::jsonb"""))


def test_pure_python_errors_are_the_same_classes() -> None:
    with pytest.raises(errors.ArgumentEmpty) as info:
        idem.derive_key("s", "", "step")
    assert info.value.sqlstate == "IK011" and info.value.argument == "key"
    assert isinstance(info.value, idem.InvalidArgument)
    from pg_idempotency.fingerprint import InvalidArgument

    assert InvalidArgument is errors.InvalidArgument


# -- the operation() flow --------------------------------------------------------------------

async def test_operation_complete_then_replay(flavour: Any, db: str) -> None:
    api, conn = flavour
    req = {"amount": 5}
    for attempt in range(2):
        op = api.operation(conn, "acct", "op1", req)
        async with _enter(op) as op:
            if attempt == 0:
                assert op.outcome is idem.Outcome.CLAIMED and op.replay is None
                await insert(conn, 5)
                response = await call(op.complete(201, {"ok": True},
                                                  headers={"Location": "/x/1"}))
                assert response.status == 201
            else:
                assert op.outcome is idem.Outcome.REPLAY
                assert op.replay.status == 201 and op.replay.json() == {"ok": True}
                assert op.replay.headers == {"Location": "/x/1"}
                with pytest.raises(idem.UsageError, match="replay"):
                    await call(op.complete(200, {}))
    assert ledger_count(db) == 1
    assert idle(conn)


async def test_operation_errors_release_or_keep(flavour: Any, db: str) -> None:
    api, conn = flavour
    # before any side effect: rolled back and released, a retry with another body runs afresh
    with pytest.raises(ZeroDivisionError):
        async with _enter(api.operation(conn, "acct", "op2", {"v": 1})):
            await insert(conn, 1)
            1 / 0  # noqa: B018
    released = released_token(db, "op2")
    assert key_row(db, "op2") == ("released", None, 1) and ledger_count(db) == 0
    async with _enter(api.operation(conn, "acct", "op2", {"v": 2})) as op:
        assert op.outcome is idem.Outcome.CLAIMED and op.attempts == 1
        assert op.lease_token > released
        await call(op.complete(200, None))
    assert key_row(db, "op2") == ("completed", None, 1)

    # after a checkpoint: the step's writes stay, later writes roll back, the key stays
    t0 = datetime.now(timezone.utc)
    with pytest.raises(TimeoutError):
        async with _enter(api.operation(conn, "acct", "op3", {"v": 3}, lease=5,
                                        reference_time=t0)) as op:
            await insert(conn, 10)
            await call(op.checkpoint("charge_created"))
            await insert(conn, 20)
            raise TimeoutError("processor did not answer")
    assert key_row(db, "op3") == ("in_progress", "charge_created", 1)
    with psycopg.connect(db) as c:
        assert c.execute("SELECT array_agg(amount) FROM ledger").fetchone()[0] == [10]
    # a derived downstream key makes a failure ambiguous too
    with pytest.raises(ConnectionError):
        async with _enter(api.operation(conn, "acct", "op4", {"v": 4})) as op:
            assert op.derive_key("charge") == idem.derive_key("acct", "op4", "charge")
            raise ConnectionError
    assert key_row(db, "op4")[0] == "in_progress"

    # the retry after expiry resumes from the recovery point
    async with _enter(api.operation(conn, "acct", "op3", {"v": 3},
                                    reference_time=t0 + timedelta(seconds=6))) as op:
        assert op.outcome is idem.Outcome.RESUMED and op.recovery_point == "charge_created"
        assert op.attempts == 2
        await call(op.complete(201, {"resumed": True}))
    # while the lease is live: KeyInProgress; another request: KeyMismatch
    with pytest.raises(idem.KeyInProgress) as busy:
        async with _enter(api.operation(conn, "acct", "op4", {"v": 4})):
            pass
    assert busy.value.retry_after > timedelta(0)
    with pytest.raises(idem.KeyMismatch):
        async with _enter(api.operation(conn, "acct", "op3", {"v": 99})):
            pass

    # a block that returns without complete() (an early 402): rolled back and released, no
    # error; after a checkpoint the same return keeps the key for a resume
    async with _enter(api.operation(conn, "acct", "op5", {})) as op:
        await insert(conn, 7)
    assert op.released and key_row(db, "op5") == ("released", None, 1) and ledger_count(db) == 1
    assert released_token(db, "op5") == op.lease_token
    async with _enter(api.operation(conn, "acct", "op6", {})) as op:
        await call(op.checkpoint("step1"))
    assert not op.released and key_row(db, "op6") == ("in_progress", "step1", 1)


async def test_complete_rolls_back_with_the_business_write_when_the_lease_was_lost(
        flavour: Any, db: str) -> None:
    api, conn = flavour
    t0 = datetime.now(timezone.utc)
    with pytest.raises(idem.LeaseLost):
        async with _enter(api.operation(conn, "acct", "lost", {"v": 1}, lease=1,
                                        reference_time=t0)) as op:
            await insert(conn, 50)
            # meanwhile the lease expired and a retry took the key over
            with psycopg.connect(db, autocommit=True) as other:
                r = idem.claim(other, "acct", "lost", {"v": 1},
                               reference_time=t0 + timedelta(seconds=2))
                assert r.outcome is idem.Outcome.RESUMED
            await call(op.complete(201, {"id": 1}))
    assert ledger_count(db) == 0
    assert key_row(db, "lost") == ("in_progress", None, 2)


async def test_operation_refuses_an_open_transaction(flavour: Any) -> None:
    api, conn = flavour
    await call(conn.execute("BEGIN"))
    await call(conn.execute("SELECT 1"))
    with pytest.raises(idem.UsageError, match="idle connection"):
        async with _enter(api.operation(conn, "s", "k", {})):
            pass
    await rollback(conn)


async def test_decorator(flavour: Any, db: str) -> None:
    api, conn = flavour
    runs = []

    if api is aio:
        @aio.idempotent(status=201)  # psycopg's or asyncpg's connection
        async def charge(conn: Any, amount: int, *, op: Any) -> dict[str, Any]:
            runs.append(op.key)
            await insert(conn, amount)
            return {"charged": amount, "ref": op.derive_key("processor")[:8]}
    else:
        @idem.idempotent(status=201)
        def charge(conn: Any, amount: int, *, op: Any) -> dict[str, Any]:
            runs.append(op.key)
            conn.execute("INSERT INTO ledger (account, amount) VALUES ('a', %s)", (amount,))
            return {"charged": amount, "ref": op.derive_key("processor")[:8]}

    assert inspect.iscoroutinefunction(charge) == (api is aio)
    first = await call(charge(conn, "acct", "d1", 30))
    second = await call(charge(conn, "acct", "d1", 30))
    assert first == second and first["charged"] == 30
    assert runs == ["d1"] and ledger_count(db) == 1
    with pytest.raises(idem.KeyMismatch):
        await call(charge(conn, "acct", "d1", 31))


# -- pools -----------------------------------------------------------------------------------

def test_sync_pool(db: str) -> None:
    with psycopg.connect(db, autocommit=True) as setup:
        setup.execute(LEDGER)
    with ConnectionPool(db, min_size=1, max_size=2, open=True) as pool:
        for _ in range(2):
            with pool.connection() as conn, idem.operation(conn, "p", "k", {"a": 1}) as op:
                if op.replay is None:
                    conn.execute("INSERT INTO ledger (account, amount) VALUES ('p', 1)")
                    op.complete(201, {"n": 1})
    assert ledger_count(db) == 1


async def test_async_pool(db: str) -> None:
    with psycopg.connect(db, autocommit=True) as setup:
        setup.execute(LEDGER)
    async with AsyncConnectionPool(db, min_size=1, max_size=2, open=False) as pool:
        for _ in range(2):
            async with pool.connection() as conn, aio.operation(conn, "p", "k", {"a": 1}) as op:
                if op.replay is None:
                    await conn.execute("INSERT INTO ledger (account, amount) VALUES ('p', 1)")
                    await op.complete(201, {"n": 1})
    assert ledger_count(db) == 1


@pytest.fixture(params=["sync", "async", "sync-tx", "async-tx", "asyncpg"])
async def any_conn(request: pytest.FixtureRequest, db: str) -> Any:
    """(api module, connection): autocommit, or not ("-tx"), sync or async; or asyncpg's
    (which has no implicit transaction: autocommit, as psycopg sees it); a ledger table."""
    autocommit = not request.param.endswith("-tx")
    with psycopg.connect(db, autocommit=True) as setup:
        setup.execute(LEDGER)
    if request.param == "asyncpg":
        conn = await asyncpg.connect(db)
        try:
            yield aio, conn
        finally:
            await conn.close()
    elif request.param.startswith("sync"):
        with psycopg.connect(db, autocommit=autocommit) as conn:
            yield idem, conn
    else:
        async with await psycopg.AsyncConnection.connect(db, autocommit=autocommit) as conn:
            yield aio, conn


async def test_release_before_any_side_effect(any_conn: Any, db: str) -> None:
    api, conn = any_conn
    autocommit = getattr(conn, "autocommit", True)
    async with _enter(api.operation(conn, "pay", "r1", {"card": "declined"})) as op:
        await insert(conn, 1)
        await call(op.checkpoint("asked_the_bank"))  # release() trusts the caller over this
        await insert(conn, 2)
        await call(op.release())
        assert op.released and idle(conn)
        with pytest.raises(idem.UsageError, match="released"):
            await call(op.complete(402, {"error": "declined"}))
    # the row stays, released (the recovery point is left as it was), until the next claim
    assert key_row(db, "r1") == ("released", "asked_the_bank", 1)
    released = released_token(db, "r1")
    assert released == op.lease_token
    with psycopg.connect(db) as c:  # the checkpoint committed its write; the later one is gone
        assert c.execute("SELECT array_agg(amount) FROM ledger").fetchone()[0] == [1]
    # a retry, even with another request, runs afresh, under a greater token
    async with _enter(api.operation(conn, "pay", "r1", {"card": "other"})) as op:
        assert op.outcome is idem.Outcome.CLAIMED and op.attempts == 1
        assert op.lease_token > released
        await insert(conn, 3)
        await call(op.complete(201, {"ok": True}))
    assert key_row(db, "r1") == ("completed", None, 1) and ledger_count(db) == 2
    assert getattr(conn, "autocommit", True) == autocommit
    # release() is for the owner only
    async with _enter(api.operation(conn, "pay", "r1", {"card": "other"})) as op:
        with pytest.raises(idem.UsageError, match="replay"):
            await call(op.release())


async def test_a_stale_attempt_gets_the_lease_lost_family(any_conn: Any, db: str) -> None:
    api, conn = any_conn
    autocommit = getattr(conn, "autocommit", True)
    t0 = datetime.now(timezone.utc)

    async def stale(key: str, then: str) -> tuple[pytest.ExceptionInfo[idem.LeaseLost], int]:
        with pytest.raises(idem.LeaseLost) as lost:
            async with _enter(api.operation(conn, "acct", key, {"v": 1}, lease=1,
                                            reference_time=t0)) as op:
                await insert(conn, 50)
                # meanwhile the lease expired; a retry took the key over and finished
                with psycopg.connect(db, autocommit=True) as other:
                    r = idem.claim(other, "acct", key, {"v": 1},
                                   reference_time=t0 + timedelta(seconds=2))
                    assert r.outcome is idem.Outcome.RESUMED
                    assert r.lease_token > op.lease_token
                    if then == "complete":
                        idem.complete(other, "acct", key, r.lease_token, 201, {"id": 2},
                                      reference_time=t0 + timedelta(seconds=2))
                    else:
                        idem.release(other, "acct", key, r.lease_token)
                await call(op.complete(201, {"id": 1}))
        return lost, r.lease_token

    # a stale attempt is told the same IK001 whether the key was completed or released by
    # the attempt that took it over (no oracle: it no longer owns the key, and that is all)
    done, done_token = await stale("done-elsewhere", "complete")
    gone, gone_token = await stale("released-elsewhere", "release")
    assert_same_lease_lost(done.value, gone.value)
    assert not isinstance(done.value, (idem.AlreadyCompleted, idem.KeyNotFound))
    assert ledger_count(db) == 0  # both business writes rolled back
    assert key_row(db, "done-elsewhere") == ("completed", None, 2)
    assert key_row(db, "released-elsewhere") == ("released", None, 2)
    assert released_token(db, "released-elsewhere") == gone_token
    # the low-level calls that take a token raise the family too: IK004 (LeaseLostCompleted)
    # only with the token that completed the key, IK001 with any other; takeover does not
    with pytest.raises(idem.LeaseLostCompleted) as own:
        await call(api.heartbeat(conn, "acct", "done-elsewhere", done_token))
    assert isinstance(own.value, idem.AlreadyCompleted) and own.value.sqlstate == "IK004"
    if not autocommit:
        await call(conn.rollback())
    with pytest.raises(idem.LeaseLost) as other_token:
        await call(api.heartbeat(conn, "acct", "done-elsewhere", done_token - 1))
    assert_same_lease_lost(other_token.value, done.value)
    if not autocommit:
        await call(conn.rollback())
    with pytest.raises(idem.LeaseLost) as on_released:
        await call(api.heartbeat(conn, "acct", "released-elsewhere", gone_token))
    assert_same_lease_lost(on_released.value, done.value)
    if not autocommit:
        await call(conn.rollback())
    with pytest.raises(idem.KeyNotFound) as missing:
        await call(api.takeover(conn, "acct", "never-claimed"))
    assert not isinstance(missing.value, idem.LeaseLost) and missing.value.sqlstate == "IK003"
    if not autocommit:
        await call(conn.rollback())
    # a released key has no owner to take over from (IK003 too); a claim starts it afresh
    with pytest.raises(idem.KeyNotFound) as released:
        await call(api.takeover(conn, "acct", "released-elsewhere"))
    assert not isinstance(released.value, idem.LeaseLost) and released.value.sqlstate == "IK003"
    if not autocommit:
        await call(conn.rollback())
    again = await call(api.claim(conn, "acct", "released-elsewhere", {"v": 1}))
    assert again.outcome is idem.Outcome.CLAIMED and again.attempts == 1
    assert again.lease_token > gone_token
    if not autocommit:
        await call(conn.commit())


def _public(obj: Any) -> dict[str, Any]:
    return {n: getattr(obj, n) for n in dir(obj) if not n.startswith("_")}


def test_sync_and_async_apis_have_the_same_functions_and_methods() -> None:
    from pg_idempotency import api

    def shape(fn: Any) -> list[tuple[str, Any, Any]]:
        params = list(inspect.signature(fn).parameters.values())
        return [(p.name, p.kind, p.default) for p in params]

    for name in api.__all__:
        sync, asynchronous = getattr(api, name), getattr(aio, name)
        if inspect.isfunction(sync) and name != "derive_key":
            assert shape(sync) == shape(asynchronous), name
            assert inspect.iscoroutinefunction(asynchronous) == (name not in (
                "operation", "idempotent")), name
    # derive_key() and mark_side_effect() send nothing: sync in both (OperationFields)
    shared = {"derive_key", "mark_side_effect"}
    sync_methods = {n: m for n, m in _public(api.Operation).items()
                    if callable(m) and n not in shared}
    async_methods = {n: m for n, m in _public(aio.Operation).items()
                     if callable(m) and n not in shared}
    assert sorted(sync_methods) == sorted(async_methods)
    assert {"checkpoint", "complete", "accept", "release"} <= set(sync_methods)
    for name, method in sync_methods.items():
        assert shape(method) == shape(async_methods[name]), name
        assert inspect.iscoroutinefunction(async_methods[name]), name
    assert (set(dir(api.Operation)) ^ {"__enter__", "__exit__"}) == (
        set(dir(aio.Operation)) ^ {"__aenter__", "__aexit__"})
    # what both forward to the shared core
    for attr in ("outcome", "replay", "accepted", "response", "released", "recovery_point",
                 "attempts", "lease_token", "claim_result", "derive_key", "mark_side_effect"):
        assert hasattr(idem.core.OperationCore, attr) or attr in vars(
            idem.core.OperationCore("s", "k")), attr


def wire(conn: psycopg.Connection[Any], fn: Any) -> dict[str, int]:
    """What ``fn()`` sends on ``conn``, from libpq's protocol trace: ``round_trips`` (Sync or
    simple Query messages: each waits for the server) and ``statements`` (Execute or Query)."""
    with tempfile.TemporaryFile("w+") as f:
        conn.pgconn.trace(f.fileno())
        conn.pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)
        try:
            fn()
        finally:
            conn.pgconn.untrace()
        f.seek(0)
        if os.environ.get("WIRE_DUMP"):
            print(f.read())
            f.seek(0)
        sent = [line.split("\t")[2].split(" ")[0] for line in f.read().splitlines()
                if line.startswith("F\t")]
    return {"round_trips": sum(m in ("Sync", "Query") for m in sent),
            "statements": sum(m in ("Execute", "Query") for m in sent)}


@pytest.mark.parametrize("autocommit", [True, False], ids=["autocommit", "tx"])
def test_round_trips_of_a_fresh_request_and_a_replay(db: str, autocommit: bool) -> None:
    with psycopg.connect(db, autocommit=True) as setup:
        setup.execute(LEDGER)
    with psycopg.connect(db, autocommit=autocommit) as conn:

        def handle() -> None:
            with idem.operation(conn, "rt", "k", {"amount": 1}) as op:
                if op.replay is None:
                    conn.execute("INSERT INTO ledger (account, amount) VALUES ('a', 1)")
                    op.complete(201, {"id": 1})

        fresh, replay = wire(conn, handle), wire(conn, handle)
        # also in the caller's own pipeline (opt-in): the write joins complete's round trip
        def piped() -> None:
            with idem.operation(conn, "rt", "k2", {"amount": 1}) as op, conn.pipeline():
                conn.execute("INSERT INTO ledger (account, amount) VALUES ('a', 2)")
                op.complete(201, {"id": 2})

        in_pipeline = wire(conn, piped)
        assert conn.autocommit == autocommit
    print(f"\nround trips autocommit={autocommit}: fresh {fresh} replay {replay} "
          f"pipeline {in_pipeline}")
    assert ledger_count(db) == 2
    # claim; BEGIN; the write; complete + COMMIT in one simple Query message. A replay: the
    # claim alone.
    assert fresh == {"round_trips": 4, "statements": 4}
    assert replay == {"round_trips": 1, "statements": 1}
    assert in_pipeline["round_trips"] == 3


# -- the request's fingerprint, computed in the package (issue 32) ------------------------------

PAYMENT = {"amount": 1999, "currency": "EUR", "description": "zebra-marker-7731",
           "metadata": {"customer": {"id": "cus_1", "tier": "gold"}, "tags": ["a", "b"],
                        "rate": 1.50, "note": "caf\u00e9 \u2603\n"}}


def test_the_request_never_crosses_the_wire_and_the_server_agrees(db: str) -> None:
    """operation() and claim() send the request's fingerprint (request => NULL): the request's
    text is nowhere in the protocol trace, the stored fingerprint is the server's own
    idempotency.fingerprint of the request, and the server path (psql, another language)
    claiming the same key with the same request replays instead of a mismatch."""
    with psycopg.connect(db, autocommit=True) as conn:

        def handle() -> None:
            with idem.operation(conn, "fp", "k1", PAYMENT) as op:
                op.complete(201, {"id": 1})

        with tempfile.TemporaryFile("w+") as f:
            conn.pgconn.trace(f.fileno())
            try:
                handle()
                idem.claim(conn, "fp", "k2", PAYMENT)
            finally:
                conn.pgconn.untrace()
            f.seek(0)
            trace = f.read()
        assert "idempotency.claim" in trace and trace.count("zebra-marker") == 0
        text = psycopg.types.json.Jsonb(PAYMENT)
        stored, server = conn.execute(
            "SELECT k.fingerprint, idempotency.fingerprint(%s) FROM idempotency.keys AS k"
            " WHERE k.scope = 'fp' ORDER BY k.key", (text,)).fetchall()[0]
        assert stored == server == idem.fingerprint(PAYMENT)
        outcomes = [conn.execute(
            "SELECT outcome FROM idempotency.claim(scope => 'fp', key => %s, request => %s)",
            (key, text)).fetchone()[0] for key in ("k1", "k2")]
        assert outcomes == ["replay", "in_progress"]
        other = conn.execute(
            "SELECT outcome FROM idempotency.claim(scope => 'fp', key => 'k1', request => %s)",
            (psycopg.types.json.Jsonb({**PAYMENT, "amount": 2000}),)).fetchone()[0]
        assert other == "mismatch"


async def test_request_limits_hold_in_the_package(flavour: Any, db: str) -> None:
    """What claim refuses in a request it refuses in the package, with claim's SQLSTATEs,
    before anything is sent: nesting deeper than 128 (IK014) and a canonical text over
    max_request_bytes' default (IK018); one at the limit is claimed."""
    api, conn = flavour
    deep: Any = "x"
    for _ in range(129):
        deep = [deep]
    limit = MAX_REQUEST_BYTES
    big = {"b": "x" * (limit - 7)}  # {"b":"...."} is 8 bytes more than its string
    cases = [(errors.ArgumentOutOfRange, "IK014", deep),
             (errors.ArgumentTooLarge, "IK018", big)]
    for cls, state, request in cases:
        for via_operation in (False, True):
            with pytest.raises(cls) as info:
                if via_operation:
                    async with _enter(api.operation(conn, "lim", "k", request)):
                        pass
                else:
                    await call(api.claim(conn, "lim", "k", request))
            e = info.value
            assert (e.sqlstate, e.argument, e.function) == (state, "request", "idempotency.claim")
            assert e.pgerror is None  # refused before a statement was sent
    assert "the limit (settings.max_request_bytes) is 1048576 bytes" in e.detail
    assert key_row(db, "k") is None
    at_limit = {"b": "x" * (limit - 8)}
    assert len(idem.canonical_json(at_limit).encode()) == limit
    claimed = await call(api.claim(conn, "lim", "k", at_limit))
    assert claimed.outcome is idem.Outcome.CLAIMED
    assert key_row(db, "k") == ("in_progress", None, 1)


# -- helpers ---------------------------------------------------------------------------------

