"""Operations and the ASGI middleware over an asyncpg pool: the connection follows the SQL as
over a psycopg pool (test_pool_lifecycle.py). Handlers parked in a provider call hold no
connection, cancelled requests give theirs back, and a lost backend or a stopped server answers
503 with Retry-After, never 500."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import uuid
from collections.abc import Iterator
from typing import Any

import asyncpg
import httpx
import psycopg
import pytest
from helpers import MIGRATION_PSQL_ARGS, MIGRATIONS
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pg_idempotency import aio, errors
from pg_idempotency import asgi as pg_asgi
from pgharness import WAIT_BOUND, PgServer, flavour_bindir

pytestmark = pytest.mark.anyio

APP = "asyncpg-pool-app"
LEDGER = "CREATE TABLE IF NOT EXISTS ledger (intent text NOT NULL)"


def _setup(db: str) -> None:
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute(LEDGER)


async def _pool(db: str, size: int, **kwargs: Any) -> asyncpg.Pool:
    return await asyncpg.create_pool(db, min_size=size, max_size=size,
                                     server_settings={"application_name": APP}, **kwargs)


def _app_sessions(db: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(db, autocommit=True) as conn:
        return conn.execute(
            "SELECT state, query FROM pg_stat_activity WHERE application_name = %s",
            (APP,)).fetchall()


async def _await_clean(db: str, pool: asyncpg.Pool) -> None:
    """Every connection back in the pool, and no session of the app idle in transaction."""
    for _ in range(int(WAIT_BOUND / 0.02)):
        if pool.get_idle_size() == pool.get_size():
            break
        await asyncio.sleep(0.02)
    assert pool.get_idle_size() == pool.get_size(), (pool.get_idle_size(), pool.get_size())
    assert [s for s in _app_sessions(db) if s[0] != "idle"] == []


def _ledger(db: str) -> list[str]:
    with psycopg.connect(db) as conn:
        return [r[0] for r in conn.execute("SELECT intent FROM ledger ORDER BY intent")]


def _answer(intent: str) -> bytes:
    return json.dumps({"intent": intent, "execution": uuid.uuid4().hex}).encode()


async def test_an_operation_over_the_pool_holds_a_connection_only_while_sql_runs(
        db: str) -> None:
    _setup(db)
    pool = await _pool(db, 2)
    try:
        async with aio.operation(pool, "p", "k1", {"a": 1}) as op:
            assert pool.get_idle_size() == 2  # the claim's connection is back
            assert op.conn.is_in_transaction() is False  # none taken yet
            await op.conn.execute("INSERT INTO ledger (intent) VALUES ($1)", "step")
            assert pool.get_idle_size() == 1 and op.conn.is_in_transaction()
            await op.checkpoint("charged")  # commits, and gives the connection back
            assert pool.get_idle_size() == 2
            conn = await op.connection()  # the connection itself, kept to the end
            async with conn.transaction():  # a savepoint in the operation's transaction
                await conn.execute("INSERT INTO ledger (intent) VALUES ($1)", "done")
            assert await op.conn.fetchval("SELECT count(*) FROM ledger") == 2
            await op.complete(201, {"n": 1})
        assert pool.get_idle_size() == 2
        async with aio.operation(pool, "p", "k1", {"a": 1}) as op:
            assert op.replay is not None and op.replay.json() == {"n": 1}
            with pytest.raises(errors.UsageError, match="not open"):
                await op.conn.execute("SELECT 1")
        # a block that raises before any side effect: rolled back, the key released
        with pytest.raises(ValueError, match="boom"):
            async with aio.operation(pool, "p", "k2", {}) as op:
                await op.conn.execute("INSERT INTO ledger (intent) VALUES ($1)", "gone")
                raise ValueError("boom")
        await _await_clean(db, pool)
    finally:
        await pool.close()
    assert _ledger(db) == ["done", "step"]
    with psycopg.connect(db) as c:
        assert c.execute("SELECT key, state FROM idempotency.keys ORDER BY key").fetchall() == [
            ("k1", "completed"), ("k2", "released")]


def _parking_app(pool: asyncpg.Pool, gate: asyncio.Event, parked: list[str]) -> Any:
    async def pay(request: Request) -> Response:
        op = pg_asgi.get_operation(request)
        assert op is not None
        data = json.loads(await request.body())
        if data.get("park"):
            parked.append(data["intent"])
            await gate.wait()  # the provider call
        await op.conn.execute("INSERT INTO ledger (intent) VALUES ($1)", data["intent"])
        return Response(_answer(data["intent"]), status_code=201,
                        media_type="application/json")

    app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    app.add_middleware(pg_asgi.IdempotencyMiddleware, pool=pool, scope=lambda r: "acct",
                       routes={"POST /pay": "required"}, wait=WAIT_BOUND)
    return app


async def test_handlers_in_a_provider_call_hold_no_connection(db: str) -> None:
    """8 keyed requests parked in their handler with an asyncpg pool of 2, and duplicates of
    one of them polling: the pool is all idle meanwhile, another request runs and commits;
    then each of the 8 is written once and the duplicates replay its answer."""
    _setup(db)
    pool = await _pool(db, 2)
    gate = asyncio.Event()
    parked: list[str] = []
    app = _parking_app(pool, gate, parked)
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                     timeout=WAIT_BOUND) as client:
            def pay(intent: str, park: bool) -> Any:
                return client.post("/pay", json={"intent": intent, "park": park},
                                   headers={"Idempotency-Key": intent})

            waiting = [asyncio.create_task(pay(f"p{i}", True)) for i in range(8)]
            for _ in range(int(WAIT_BOUND / 0.01)):
                if len(parked) == 8:
                    break
                await asyncio.sleep(0.01)
            assert len(parked) == 8
            duplicates = [asyncio.create_task(pay("p0", True)) for _ in range(4)]
            await asyncio.sleep(0.3)
            assert not any(t.done() for t in duplicates)
            assert pool.get_idle_size() == 2
            assert [s for s in _app_sessions(db) if s[0] != "idle"] == []
            other = await pay("other", False)
            assert other.status_code == 201, other.text
            gate.set()
            answers = await asyncio.gather(*waiting)
            assert [a.status_code for a in answers] == [201] * 8
            for duplicate in await asyncio.gather(*duplicates):
                assert duplicate.headers["idempotent-replayed"] == "true"
                assert duplicate.content == answers[0].content
        await _await_clean(db, pool)
    finally:
        await pool.close()
    assert _ledger(db) == sorted(["other", *(f"p{i}" for i in range(8))])


async def test_50_concurrent_identical_posts(db: str) -> None:
    """50 identical keyed POSTs at once through the middleware on an asyncpg pool of 4: the
    handler runs once; every other answer is its replay or a 409 with Retry-After."""
    _setup(db)
    pool = await _pool(db, 4)
    runs: list[str] = []

    async def pay(request: Request) -> Response:
        op = pg_asgi.get_operation(request)
        assert op is not None
        runs.append("run")
        await op.conn.execute("INSERT INTO ledger (intent) VALUES ($1)", "once")
        await asyncio.sleep(0.1)
        return Response(_answer("once"), status_code=201, media_type="application/json")

    app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    app.add_middleware(pg_asgi.IdempotencyMiddleware, pool=pool, scope=lambda r: "acct",
                       routes={"POST /pay": "required"})
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t", timeout=WAIT_BOUND) as client:
            answers = await asyncio.gather(*(
                client.post("/pay", json={"intent": "once"}, headers={"Idempotency-Key": "k"})
                for _ in range(50)))
        await _await_clean(db, pool)
    finally:
        await pool.close()
    fresh = [a for a in answers if a.status_code == 201 and "idempotent-replayed" not in a.headers]
    assert len(fresh) == 1 and runs == ["run"] and _ledger(db) == ["once"]
    for a in answers:
        if a.status_code == 409:
            assert int(a.headers["retry-after"]) >= 1
        else:
            assert a.status_code == 201 and a.content == fresh[0].content, a.text


async def test_cancelled_requests_give_their_connection_back(db: str) -> None:
    """Requests cancelled at random moments (claim, provider call, INSERT, complete, COMMIT):
    the pool is idle afterwards, no session idle in transaction, and a ledger row exists
    exactly for each completed key."""
    _setup(db)
    pool = await _pool(db, 3)

    async def pay(request: Request) -> Response:
        op = pg_asgi.get_operation(request)
        assert op is not None
        data = json.loads(await request.body())
        await asyncio.sleep(data["provider"])
        await op.conn.execute("INSERT INTO ledger (intent) VALUES ($1)", data["intent"])
        return Response(_answer(data["intent"]), status_code=201)

    app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    app.add_middleware(pg_asgi.IdempotencyMiddleware, pool=pool, scope=lambda r: "acct",
                       routes={"POST /pay": "required"})
    rng = random.Random(51)

    async def call(intent: str, provider: float) -> None:
        body = json.dumps({"intent": intent, "provider": provider}).encode()
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop()
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

        async def send(message: dict[str, Any]) -> None:
            pass

        scope = {"type": "http", "method": "POST", "path": "/pay", "query_string": b"",
                 "headers": [(b"idempotency-key", intent.encode()),
                             (b"content-type", b"application/json")], "state": {}}
        await app(scope, receive, send)

    try:
        for wave in range(3):
            tasks = []
            for i in range(20):
                task = asyncio.create_task(call(f"w{wave}-{i}", rng.uniform(0, 0.02)))
                tasks.append(task)
                asyncio.get_running_loop().call_later(rng.uniform(0, 0.05), task.cancel)
            await asyncio.gather(*tasks, return_exceptions=True)
            await _await_clean(db, pool)
    finally:
        await pool.close()
    with psycopg.connect(db) as conn:
        completed = {r[0] for r in conn.execute(
            "SELECT key FROM idempotency.keys WHERE completed_at IS NOT NULL")}
    ledger = _ledger(db)
    assert len(ledger) == len(set(ledger)) and set(ledger) == completed


# -- outages: 503 with Retry-After, never 500 ----------------------------------------------------

@pytest.fixture(scope="module")
def srv() -> Iterator[PgServer]:
    with PgServer(flavour_bindir("pg18"), name="asyncpg-outage") as server:
        dsn = server.dsn()
        for migration in sorted(MIGRATIONS.glob("*.sql")):
            server.run_psql(dsn, migration, args=MIGRATION_PSQL_ARGS)
        _setup(dsn)
        yield server


def _outage_app(pool: asyncpg.Pool, in_handler: Any) -> Any:
    async def pay(request: Request) -> Response:
        op = pg_asgi.get_operation(request)
        assert op is not None
        await op.conn.execute("INSERT INTO ledger (intent) VALUES ('x')")
        await in_handler()
        await op.conn.execute("INSERT INTO ledger (intent) VALUES ('y')")
        return Response(b"{}", status_code=201, media_type="application/json")

    app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    app.add_middleware(pg_asgi.IdempotencyMiddleware, pool=pool, scope=lambda r: "acct",
                       routes={"POST /pay": "required"}, unavailable_retry_after=2)
    return app


async def _post(app: Any, key: str) -> httpx.Response:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                 timeout=WAIT_BOUND) as client:
        return await client.post("/pay", json={"a": 1}, headers={"Idempotency-Key": key})


async def test_a_killed_backend_and_a_stopped_server_answer_503(srv: PgServer) -> None:
    dsn = srv.dsn()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE ledger")
        conn.execute("DELETE FROM idempotency.keys")

    def kill() -> None:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                          " WHERE application_name = %s AND state <> 'idle'", (APP,))

    async def kill_in_handler() -> None:
        kill()

    pool = await _pool(dsn, 2)
    try:
        lost = await _post(_outage_app(pool, kill_in_handler), "killed")
        assert lost.status_code == 503 and lost.headers["retry-after"] == "2", lost.text
        assert _ledger(dsn) == []
        # the pool replaces the killed connection: the next request goes through
        async def nothing() -> None:
            pass

        ok = await _post(_outage_app(pool, nothing), "after")
        assert ok.status_code == 201, ok.text

        # the server stops while a handler runs, and stays down for the next request
        async def stop() -> None:
            assert srv._pg is not None and srv._pg.child_process is not None
            srv._pg.child_process.send_signal(signal.SIGINT)
            srv._pg.child_process.wait(WAIT_BOUND)
            srv._pg.child_process = None

        stopped = await _post(_outage_app(pool, stop), "stopped")
        assert stopped.status_code == 503 and stopped.headers["retry-after"] == "2"
        down = await _post(_outage_app(pool, nothing), "down")
        assert down.status_code == 503 and down.headers["retry-after"] == "2", down.text
        with pytest.raises(errors.DatabaseUnavailable):
            async with aio.operation(pool, "acct", "direct", {}):
                pass
    finally:
        pool.terminate()
        srv.restart()
    assert _ledger(dsn) == ["x", "y"]  # only the request that went through
    with psycopg.connect(dsn) as c:
        states = dict(c.execute("SELECT key, state FROM idempotency.keys").fetchall())
    # nothing stored for the lost ones (released, or kept until the lease expires)
    assert states.pop("after") == "completed"
    assert set(states) <= {"killed", "stopped"} and "completed" not in states.values()
