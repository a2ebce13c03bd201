"""The async API on asyncpg connections, beyond what test_api.py runs on both drivers: real
concurrent asyncpg sessions racing one key, asyncpg's own transactions inside an operation,
a codec an application registered, and a lost connection."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from typing import Any

import asyncpg
import psycopg
import pytest

import pg_idempotency as idem
from pg_idempotency import aio, errors

pytestmark = pytest.mark.anyio

LEDGER = "CREATE TABLE ledger (id serial PRIMARY KEY, ref text, amount integer)"


def rows(db: str, sql: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(db) as conn:
        return conn.execute(sql).fetchall()


@pytest.fixture
async def conn(db: str) -> Any:
    with psycopg.connect(db, autocommit=True) as setup:
        setup.execute(LEDGER)
    c = await asyncpg.connect(db)
    try:
        yield c
    finally:
        await c.close()


async def test_racing_sessions_one_executes_the_others_replay_or_wait(db: str) -> None:
    """50 asyncpg connections claim one key at once: one runs the block (its write and the
    answer commit together), every other gets KeyInProgress (the 409) while it runs or the
    stored answer once it is done; nothing runs twice."""
    with psycopg.connect(db, autocommit=True) as setup:
        setup.execute(LEDGER)
    conns = [await asyncpg.connect(db) for _ in range(50)]
    start = asyncio.Event()
    ran: list[int] = []

    async def attempt(i: int, c: Any) -> str:
        await start.wait()
        try:
            async with aio.operation(c, "race", "k", {"amount": 5}) as op:
                if op.replay is not None:
                    assert op.replay.status == 201 and op.replay.json() == {"ran": 0}
                    return "replay"
                ran.append(i)
                await c.execute("INSERT INTO ledger (ref, amount) VALUES ('k', 5)")
                await asyncio.sleep(0.2)  # the others arrive while it holds the key
                await op.complete(201, {"ran": 0})
                return "executed"
        except errors.KeyInProgress as exc:
            assert exc.retry_after is not None
            return "in_progress"

    try:
        tasks = [asyncio.ensure_future(attempt(i, c)) for i, c in enumerate(conns)]
        await asyncio.sleep(0.05)
        start.set()
        results = await asyncio.gather(*tasks)
        again = await attempt(99, conns[0])
    finally:
        for c in conns:
            await c.close()
    assert results.count("executed") == 1 and len(ran) == 1
    assert results.count("in_progress") + results.count("replay") == 49
    assert results.count("in_progress") > 0
    assert again == "replay"
    assert rows(db, "SELECT count(*) FROM ledger") == [(1,)]
    assert rows(db, "SELECT state, response_status FROM idempotency.keys") == [
        ("completed", 201)]


async def test_a_transaction_block_inside_the_operation_is_a_savepoint(
        conn: Any, db: str) -> None:
    """asyncpg's ``conn.transaction()`` inside the block nests in the operation's transaction
    (a savepoint): its writes commit with complete(), and one rolled back leaves the others."""
    async with aio.operation(conn, "tx", "k1", {}) as op:
        async with conn.transaction():
            await conn.execute("INSERT INTO ledger (ref, amount) VALUES ('kept', 1)")
        with pytest.raises(ZeroDivisionError):
            async with conn.transaction():
                await conn.execute("INSERT INTO ledger (ref, amount) VALUES ('undone', 2)")
                1 / 0  # noqa: B018
        assert conn.is_in_transaction()
        await op.complete(201, {"ok": True})
    assert not conn.is_in_transaction()
    assert rows(db, "SELECT ref FROM ledger") == [("kept",)]
    # a block that raises rolls back everything since the claim and releases the key
    with pytest.raises(ValueError, match="no"):
        async with aio.operation(conn, "tx", "k2", {}):
            async with conn.transaction():
                await conn.execute("INSERT INTO ledger (ref, amount) VALUES ('gone', 3)")
            raise ValueError("no")
    assert rows(db, "SELECT ref FROM ledger") == [("kept",)]
    assert rows(db, "SELECT state FROM idempotency.keys WHERE key = 'k2'") == [("released",)]
    # and the connection is usable with asyncpg's own transactions afterwards
    async with conn.transaction():
        await conn.execute("INSERT INTO ledger (ref, amount) VALUES ('after', 4)")
    assert rows(db, "SELECT count(*) FROM ledger") == [(2,)]


async def test_an_application_codec_changes_nothing(conn: Any, db: str) -> None:
    """An application's jsonb codec (json.dumps/json.loads, asyncpg's documented recipe) and a
    session TimeZone and DateStyle of its own: the package's JSON is stored once-encoded, its
    times read the same."""
    await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads,
                              schema="pg_catalog")
    await conn.execute("SET TimeZone = 'Asia/Kathmandu'; SET DateStyle = 'SQL, DMY'")
    async with aio.operation(conn, "codec", "k", {"a": [1, 2]}) as op:
        await op.complete(201, {"id": 7}, headers={"Location": "/x/7"})
    first = op.response
    async with aio.operation(conn, "codec", "k", {"a": [1, 2]}) as op:
        assert op.replay is not None
        assert op.replay.json() == {"id": 7} and op.replay.headers == {"Location": "/x/7"}
        assert op.replay.completed_at == first.completed_at
    assert rows(db, "SELECT jsonb_typeof(response_headers) FROM idempotency.keys") == [
        ("object",)]
    started = await aio.claim(conn, "codec", "k2", {"v": 1})
    accepted_until = await aio.accept(conn, "codec", "k2", started.lease_token, 202,
                                      {"job": 1})
    assert accepted_until > started.lease_expires_at - timedelta(seconds=1)
    interim = await aio.claim(conn, "codec", "k2", {"v": 1})
    assert interim.outcome is idem.Outcome.ACCEPTED and interim.response.json() == {"job": 1}


async def test_a_killed_backend_is_database_unavailable(conn: Any, db: str) -> None:
    """The backend terminated during the block (57P01, then a closed connection): the block's
    own statement and the package's calls raise DatabaseUnavailable, nothing is stored."""
    pid = await conn.fetchval("SELECT pg_backend_pid()")
    with pytest.raises(errors.DatabaseUnavailable) as lost:
        async with aio.operation(conn, "kill", "k", {}):
            await conn.execute("INSERT INTO ledger (ref, amount) VALUES ('k', 1)")
            with psycopg.connect(db, autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            await conn.execute("INSERT INTO ledger (ref, amount) VALUES ('k', 2)")
    assert lost.value.pgerror is not None and "asyncpg" in type(lost.value.pgerror).__module__
    assert rows(db, "SELECT count(*) FROM ledger") == [(0,)]
    assert rows(db, "SELECT state FROM idempotency.keys") == [("in_progress",)]
    with pytest.raises(errors.DatabaseUnavailable):
        await aio.claim(conn, "kill", "k2", {})
    assert errors.is_unavailable(asyncpg.exceptions.AdminShutdownError("terminating"))
    assert not errors.is_unavailable(asyncpg.exceptions.QueryCanceledError("canceled"))
    assert not errors.is_unavailable(asyncpg.InterfaceError("another operation is in progress"))


async def test_the_decorator_and_checkpoint_share_the_operation_transaction(
        conn: Any, db: str) -> None:
    runs: list[int] = []

    @aio.idempotent(status=201)
    async def charge(c: Any, amount: int, *, op: Any) -> dict[str, Any]:
        runs.append(amount)
        await c.execute("INSERT INTO ledger (ref, amount) VALUES ('step', $1)", amount)
        await op.checkpoint("charged")
        await c.execute("INSERT INTO ledger (ref, amount) VALUES ('done', $1)", amount)
        return {"charged": amount}

    assert await charge(conn, "dec", "d1", 30) == {"charged": 30}
    assert await charge(conn, "dec", "d1", 30) == {"charged": 30}
    assert runs == [30]
    assert rows(db, "SELECT ref FROM ledger ORDER BY id") == [("step",), ("done",)]
    assert rows(db, "SELECT state, recovery_point FROM idempotency.keys") == [
        ("completed", "charged")]
    assert not conn.is_in_transaction()
    with pytest.raises(idem.KeyMismatch):
        await charge(conn, "dec", "d1", 31)


async def test_complete_over_the_limit_rolls_back_and_releases(conn: Any, db: str) -> None:
    """The package's own limit on what complete() stores holds on asyncpg as on psycopg:
    ArgumentTooLarge (IK018) before anything is sent, the writes rolled back, the key
    released; at the limit it is stored."""
    limit = 100
    with pytest.raises(errors.ArgumentTooLarge) as caught:
        async with aio.operation(conn, "lim", "over", {}, max_response_bytes=limit) as op:
            await conn.execute("INSERT INTO ledger (ref, amount) VALUES ('over', 1)")
            await op.complete(201, b"x" * (limit + 1))
    assert caught.value.argument == "body" and caught.value.pgerror is None
    async with aio.operation(conn, "lim", "at", {}, max_response_bytes=limit) as op:
        await conn.execute("INSERT INTO ledger (ref, amount) VALUES ('at', 1)")
        await op.complete(201, b"x" * limit)
    assert rows(db, "SELECT ref FROM ledger") == [("at",)]
    assert rows(db, "SELECT key, state FROM idempotency.keys ORDER BY key") == [
        ("at", "completed"), ("over", "released")]
