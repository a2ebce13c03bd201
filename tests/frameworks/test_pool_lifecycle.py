"""The connection follows the SQL, not the request: the ASGI middleware and the Flask/WSGI
adapter hold a connection of their pool only while SQL runs. Handlers parked in a slow
provider call hold none (a pool of 2 serves 8 of them and more claims meanwhile); retry storms
with client disconnects, cancellations and backend kills leave no duplicate, no lost payment,
byte-identical replays, the pool idle and no session idle in transaction."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import asyncpg
import flask
import httpx
import psycopg
import pytest
from helpers.http import uvicorn_server, with_pool_lifespan, wsgi_server
from psycopg_pool import AsyncConnectionPool, ConnectionPool
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pg_idempotency import asgi as pg_asgi
from pg_idempotency import flask as pg_flask
from pgharness import WAIT_BOUND, wait_until

APP_NAME = "pool-lifecycle-app"
LEDGER = "CREATE TABLE IF NOT EXISTS ledger (intent text NOT NULL)"


def _setup(db: str) -> None:
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute(LEDGER)


def _idle_in_transaction(db: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(db, autocommit=True) as conn:
        return conn.execute(
            "SELECT pid, application_name, state, query FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            " AND state LIKE 'idle in transaction%%'").fetchall()


def _pool_idle(pool: Any) -> bool:
    stats = pool.get_stats()
    return stats["requests_waiting"] == 0 and stats["pool_available"] == stats["pool_size"]


def _assert_clean(db: str, pool: Any) -> None:
    """Every connection back in the pool, nobody waiting for one, no session of the
    database idle in transaction."""
    wait_until(lambda: _pool_idle(pool), f"the pool back to idle ({pool.get_stats()})")
    assert _idle_in_transaction(db) == []


async def _await_clean(db: str, pool: AsyncConnectionPool) -> None:
    """:func:`_assert_clean` from the pool's event loop (which gives connections back)."""
    for _ in range(int(WAIT_BOUND / 0.02)):
        if _pool_idle(pool):
            break
        await asyncio.sleep(0.02)
    assert _pool_idle(pool), pool.get_stats()
    assert _idle_in_transaction(db) == []


def _ledger(db: str) -> list[str]:
    with psycopg.connect(db) as conn:
        return [r[0] for r in conn.execute("SELECT intent FROM ledger ORDER BY intent")]


def _answer(intent: str) -> bytes:
    # a fresh value per execution: a replay that is not the stored answer shows
    return json.dumps({"intent": intent, "execution": uuid.uuid4().hex}).encode()


# -- ASGI: handlers parked in their provider call ----------------------------------------------

def _parking_app(pool: AsyncConnectionPool, gate: asyncio.Event, parked: list[str]) -> Any:
    async def pay(request: Request) -> Response:
        op = pg_asgi.get_operation(request)
        assert op is not None
        data = json.loads(await request.body())
        if data.get("park"):
            parked.append(data["intent"])
            await gate.wait()  # the provider call
        await op.conn.execute("INSERT INTO ledger (intent) VALUES (%s)", (data["intent"],))
        return Response(_answer(data["intent"]), status_code=201,
                        media_type="application/json")

    app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    app.add_middleware(pg_asgi.IdempotencyMiddleware, pool=pool, scope=lambda r: "acct",
                       routes={"POST /pay": "required"}, wait=WAIT_BOUND)
    return app


@pytest.mark.anyio
async def test_handlers_in_a_provider_call_hold_no_connection(db: str) -> None:
    """8 keyed requests wait in their handler's provider call with a pool of 2, and 4
    duplicates of one of them wait for it (``wait``, polling): none holds a connection
    meanwhile (the pool is all available, no session is idle in transaction), and a ninth
    request is claimed, runs and commits while they wait. Then the 8 finish, each written
    once, and the duplicates replay the answer."""
    _setup(db)
    pool = AsyncConnectionPool(db, min_size=2, max_size=2, timeout=WAIT_BOUND, open=False)
    gate = asyncio.Event()
    parked: list[str] = []
    app = _parking_app(pool, gate, parked)
    await pool.open(wait=True)
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
            await asyncio.sleep(0.3)  # they claim, find p0 in progress, and poll
            assert not any(t.done() for t in duplicates)
            stats = pool.get_stats()
            assert stats["pool_available"] == 2 and stats["requests_waiting"] == 0, stats
            assert _idle_in_transaction(db) == []
            other = await pay("other", False)  # claims, writes and commits meanwhile
            assert other.status_code == 201, other.text
            assert not any(t.done() for t in waiting)
            gate.set()
            answers = await asyncio.gather(*waiting)
            assert [a.status_code for a in answers] == [201] * 8
            for duplicate in await asyncio.gather(*duplicates):
                assert duplicate.headers["idempotent-replayed"] == "true"
                assert duplicate.content == answers[0].content
            replay = await pay("p3", True)
            assert replay.headers["idempotent-replayed"] == "true"
            assert replay.content == answers[3].content
        await _await_clean(db, pool)
    finally:
        await pool.close()
    assert _ledger(db) == sorted(["other", *(f"p{i}" for i in range(8))])


# -- ASGI: cancellations at every step ---------------------------------------------------------

@pytest.mark.anyio
async def test_cancelled_requests_give_their_connection_back(db: str) -> None:
    """Keyed requests cancelled at random moments (in the claim, the provider call, the
    INSERT, complete and its COMMIT) give every connection back: the pool is idle afterwards,
    no session is idle in transaction, and a ledger row exists exactly for each completed
    key (the write and the stored answer commit together or not at all)."""
    _setup(db)
    pool = AsyncConnectionPool(db, min_size=2, max_size=3, timeout=WAIT_BOUND, open=False)

    async def pay(request: Request) -> Response:
        op = pg_asgi.get_operation(request)
        assert op is not None
        data = json.loads(await request.body())
        await asyncio.sleep(data["provider"])
        await op.conn.execute("INSERT INTO ledger (intent) VALUES (%s)", (data["intent"],))
        return Response(_answer(data["intent"]), status_code=201)

    app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    app.add_middleware(pg_asgi.IdempotencyMiddleware, pool=pool, scope=lambda r: "acct",
                       routes={"POST /pay": "required"})
    rng = random.Random(50)

    async def call(intent: str, provider: float) -> None:
        body = json.dumps({"intent": intent, "provider": provider}).encode()
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop()
            await asyncio.Event().wait()  # the client never sends more
            raise AssertionError("unreachable")

        async def send(message: dict[str, Any]) -> None:
            pass

        scope = {"type": "http", "method": "POST", "path": "/pay", "query_string": b"",
                 "headers": [(b"idempotency-key", intent.encode()),
                             (b"content-type", b"application/json")],
                 "state": {}}
        await app(scope, receive, send)

    await pool.open(wait=True)
    try:
        for wave in range(4):
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
    assert len(ledger) == len(set(ledger))
    assert set(ledger) == completed


# -- ASGI over uvicorn: retry storms with client disconnects and backend kills ------------------

def _storm_app(db: str, pool: AsyncConnectionPool | None, made: dict[str, Any]) -> Any:
    """The storm's app over ``pool``, or (None) over an asyncpg pool that its lifespan makes
    in ``made["pool"]``."""
    async def pay(request: Request) -> Response:
        op = pg_asgi.get_operation(request)
        assert op is not None
        data = json.loads(await request.body())
        await asyncio.sleep(random.uniform(0, 0.03))  # the provider
        if pool is None:
            await op.conn.execute("INSERT INTO ledger (intent) VALUES ($1)", data["intent"])
        else:
            await op.conn.execute("INSERT INTO ledger (intent) VALUES (%s)", (data["intent"],))
        return Response(_answer(data["intent"]), status_code=201,
                        media_type="application/json")

    inner = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    app = pg_asgi.IdempotencyMiddleware(
        inner, pool=pool if pool is not None else (lambda: made["pool"]), scope=lambda r: "acct",
        routes={"POST /pay": "required"}, lease=1.0, wait=0.2)
    if pool is not None:
        return with_pool_lifespan(pool, app)

    async def wrapped(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await receive()
            made["pool"] = await asyncpg.create_pool(
                db, min_size=3, max_size=3, server_settings={"application_name": APP_NAME})
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await made["pool"].close()
            await send({"type": "lifespan.shutdown.complete"})
            return
        await app(scope, receive, send)

    return wrapped


def _killer(db: str, stop: threading.Event, every: float) -> Callable[[], int]:
    """Terminate a random backend of the app every ``every`` seconds until ``stop``; returns
    a function that joins the thread and gives the number of kills."""
    kills = [0]

    def run() -> None:
        rng = random.Random(7)
        with psycopg.connect(db, autocommit=True) as conn:
            while not stop.wait(every):
                # not one still starting up: the pool would back off from a failed connect
                pids = [r[0] for r in conn.execute(
                    "SELECT pid FROM pg_stat_activity WHERE application_name = %s"
                    " AND backend_start < now() - interval '200 ms'", (APP_NAME,))]
                if pids:
                    conn.execute("SELECT pg_terminate_backend(%s)", (rng.choice(pids),))
                    kills[0] += 1

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def join() -> int:
        stop.set()
        thread.join(WAIT_BOUND)
        return kills[0]

    return join


async def _async_storm(base: str, intents: list[str], seed: int) -> dict[str, list[bytes]]:
    """Three clients per intent send the same request at once and retry until a 2xx; some
    give up mid-request (a client-side timeout closes the connection) and retry."""
    rng = random.Random(seed)
    answers: dict[str, list[bytes]] = {i: [] for i in intents}
    seen: dict[str, list[Any]] = {i: [] for i in intents}

    async def client_for(intent: str) -> None:
        body = json.dumps({"intent": intent}).encode()
        headers = {"Idempotency-Key": intent, "Content-Type": "application/json"}
        deadline = time.monotonic() + WAIT_BOUND
        while time.monotonic() < deadline:
            impatient = rng.random() < 0.3
            timeout = rng.uniform(0.002, 0.04) if impatient else WAIT_BOUND
            try:
                async with httpx.AsyncClient(base_url=base, timeout=timeout) as client:
                    r = await client.post("/pay", content=body, headers=headers)
            except httpx.TimeoutException:
                seen[intent].append("timeout")
                continue  # the client went away; it retries
            seen[intent].append((r.status_code, r.text[:80]))
            if 200 <= r.status_code < 300:
                answers[intent].append(r.content)
                return
            assert r.status_code in (409, 503), (r.status_code, r.text)
            await asyncio.sleep(rng.uniform(0.01, 0.05))
        raise AssertionError(f"{intent}: no answer in {WAIT_BOUND:g} s: {seen[intent]}")

    await asyncio.gather(*(client_for(i) for i in intents for _ in range(3)))
    return answers


@pytest.mark.parametrize("server", ["pg15"], indirect=True)
@pytest.mark.parametrize("kills", [False, True], ids=["disconnects", "disconnects-and-kills"])
@pytest.mark.parametrize("driver", ["psycopg", "asyncpg"])
def test_asgi_retry_storm(db: str, kills: bool, driver: str) -> None:
    """Retry storms through the middleware over uvicorn (pool of 3, psycopg's or asyncpg's):
    client disconnects, and then backend kills as well. 0 duplicates, 0 lost, byte-identical
    answers for each key, the pool idle and no session idle in transaction after each
    storm."""
    _setup(db)
    made: dict[str, Any] = {}
    pool = AsyncConnectionPool(db, min_size=3, max_size=3, timeout=WAIT_BOUND, open=False,
                               kwargs={"application_name": APP_NAME}) \
        if driver == "psycopg" else None
    intents = [f"{'k' if kills else 'd'}{i:02}" for i in range(24)]
    with uvicorn_server(_storm_app(db, pool, made)) as base:
        join = _killer(db, threading.Event(), 0.2) if kills else (lambda: 0)
        try:
            answers = asyncio.run(_async_storm(base, intents, seed=50 + kills))
        finally:
            killed = join()
        if kills:
            assert killed > 0
        if pool is not None:
            _assert_clean(db, pool)
        else:
            apool = made["pool"]
            wait_until(lambda: apool.get_idle_size() == apool.get_size(),
                       "the asyncpg pool back to idle")
            assert _idle_in_transaction(db) == []
    ledger = _ledger(db)
    assert ledger == sorted(intents), "duplicates or lost payments"
    for intent, bodies in answers.items():
        assert len(bodies) == 3 and len(set(bodies)) == 1, (intent, bodies)


# -- Flask / WSGI over a sync pool ------------------------------------------------------------

def test_flask_views_in_a_provider_call_hold_no_connection(db: str) -> None:
    """The Flask decorator with a pool of 2: 8 views parked in their provider call hold no
    connection, a ninth request runs meanwhile; then all finish, each written once."""
    _setup(db)
    pool = ConnectionPool(db, min_size=2, max_size=2, timeout=WAIT_BOUND, open=True)
    gate = threading.Event()
    parked: list[str] = []
    lock = threading.Lock()
    app = flask.Flask(__name__)
    idem = pg_flask.Idempotency(pool, scope=lambda r: "acct")

    @app.post("/pay")
    @idem.idempotent
    def pay() -> flask.Response:
        op = pg_flask.get_operation()
        assert op is not None
        data = flask.request.get_json()
        if data.get("park"):
            with lock:
                parked.append(data["intent"])
            gate.wait(WAIT_BOUND)  # the provider call
        op.conn.execute("INSERT INTO ledger (intent) VALUES (%s)", (data["intent"],))
        return flask.Response(_answer(data["intent"]), status=201,
                              content_type="application/json")

    def post(base: str, intent: str, park: bool) -> httpx.Response:
        return httpx.post(base + "/pay", json={"intent": intent, "park": park},
                          headers={"Idempotency-Key": intent}, timeout=WAIT_BOUND)

    try:
        with wsgi_server(app) as base, ThreadPoolExecutor(8) as executor:
            waiting = [executor.submit(post, base, f"p{i}", True) for i in range(8)]
            wait_until(lambda: len(parked) == 8, "8 views in their provider call")
            stats = pool.get_stats()
            assert stats["pool_available"] == 2 and stats["requests_waiting"] == 0, stats
            assert _idle_in_transaction(db) == []
            other = post(base, "other", False)
            assert other.status_code == 201, other.text
            assert not any(f.done() for f in waiting)
            gate.set()
            answers = [f.result() for f in waiting]
            assert [a.status_code for a in answers] == [201] * 8
            replay = post(base, "p3", True)
            assert replay.headers["idempotent-replayed"] == "true"
            assert replay.content == answers[3].content
        _assert_clean(db, pool)
    finally:
        pool.close()
    assert _ledger(db) == sorted(["other", *(f"p{i}" for i in range(8))])


@pytest.mark.parametrize("server", ["pg15"], indirect=True)
def test_wsgi_retry_storm_with_kills(db: str) -> None:
    """The WSGI middleware over a threaded server and a pool of 3, with backend kills and
    impatient clients: 0 duplicates, 0 lost, byte-identical answers, the pool idle and no
    session idle in transaction afterwards."""
    _setup(db)
    pool = ConnectionPool(db, min_size=3, max_size=3, timeout=WAIT_BOUND, open=True,
                          kwargs={"application_name": APP_NAME})
    app = flask.Flask(__name__)

    @app.post("/pay")
    def pay() -> flask.Response:
        op = pg_flask.get_operation()
        assert op is not None
        data = flask.request.get_json()
        threading.Event().wait(random.uniform(0, 0.03))  # the provider
        op.conn.execute("INSERT INTO ledger (intent) VALUES (%s)", (data["intent"],))
        return flask.Response(_answer(data["intent"]), status=201,
                              content_type="application/json")

    app.wsgi_app = pg_flask.IdempotencyMiddleware(  # type: ignore[method-assign]
        app.wsgi_app, pool=pool, scope=lambda environ: "acct", routes={"POST /pay": "required"},
        lease=1.0, wait=0.2)
    intents = [f"w{i:02}" for i in range(16)]
    rng = random.Random(51)
    answers: dict[str, list[bytes]] = {i: [] for i in intents}
    lock = threading.Lock()

    def client_for(base: str, intent: str) -> None:
        body = json.dumps({"intent": intent}).encode()
        headers = {"Idempotency-Key": intent, "Content-Type": "application/json"}
        deadline = time.monotonic() + WAIT_BOUND
        while time.monotonic() < deadline:
            with lock:
                impatient = rng.random() < 0.3
                timeout = rng.uniform(0.002, 0.04) if impatient else WAIT_BOUND
            try:
                r = httpx.post(base + "/pay", content=body, headers=headers, timeout=timeout)
            except httpx.TimeoutException:
                continue
            if 200 <= r.status_code < 300:
                with lock:
                    answers[intent].append(r.content)
                return
            assert r.status_code in (409, 503), (r.status_code, r.text)
            threading.Event().wait(0.02)
        raise AssertionError(f"{intent}: no answer in {WAIT_BOUND:g} s")

    try:
        with wsgi_server(app) as base:
            join = _killer(db, threading.Event(), 0.2)
            try:
                with ThreadPoolExecutor(12) as executor:
                    for f in [executor.submit(client_for, base, i)
                              for i in intents for _ in range(2)]:
                        f.result()
            finally:
                killed = join()
            assert killed > 0
            _assert_clean(db, pool)
    finally:
        pool.close()
    assert _ledger(db) == sorted(intents), "duplicates or lost payments"
    for intent, bodies in answers.items():
        assert len(bodies) == 2 and len(set(bodies)) == 1, (intent, bodies)


# -- a first statement that finds no connection free in time ----------------------------------

def _starving_flask_app(pool: ConnectionPool, middleware: bool,
                        steps: dict[str, threading.Event]) -> flask.Flask:
    app = flask.Flask(__name__)

    def pay() -> flask.Response:
        op = pg_flask.get_operation()
        assert op is not None
        data = flask.request.get_json()
        if data.get("starve"):
            steps["claimed"].set()
            steps["held"].wait(WAIT_BOUND)  # the test holds the pool's only connection
            try:
                op.conn.execute("INSERT INTO ledger (intent) VALUES (%s)", (data["intent"],))
            finally:  # PoolTimeout: Flask makes it its 500, once the pool has one again
                steps["starved"].set()
                steps["freed"].wait(WAIT_BOUND)
        op.conn.execute("INSERT INTO ledger (intent) VALUES (%s)", (data["intent"],))
        return flask.Response(_answer(data["intent"]), status=201,
                              content_type="application/json")

    if middleware:
        app.add_url_rule("/pay", "pay", pay, methods=["POST"])
        app.wsgi_app = pg_flask.IdempotencyMiddleware(  # type: ignore[method-assign]
            app.wsgi_app, pool=pool, scope=lambda environ: "acct",
            routes={"POST /pay": "required"})
    else:
        idem = pg_flask.Idempotency(pool, scope=lambda r: "acct")
        app.add_url_rule("/pay", "pay", idem.idempotent(pay), methods=["POST"])
    return app


def _assert_starved_answer(status: int, headers: Any, body: bytes) -> None:
    assert status == 503, body
    assert headers["content-type"] == "application/problem+json"
    assert int(headers["retry-after"]) >= 1
    assert json.loads(body)["title"] == "No database connection"


@pytest.mark.parametrize("middleware", [False, True], ids=["decorator", "middleware"])
def test_flask_view_without_a_free_connection_answers_503(db: str, middleware: bool) -> None:
    """The view's first statement finds the pool's only connection taken (PoolTimeout) and
    Flask answers its 500; by the time the adapter rolls back and releases, the pool has one
    again (a server back from a restart). That 500 is the pool's doing: 503 "No database
    connection" with Retry-After, nothing written, the key released (the retry runs at once,
    201, one ledger row), the pool idle."""
    _setup(db)
    pool = ConnectionPool(db, min_size=1, max_size=1, timeout=0.3, open=True)
    steps = {name: threading.Event() for name in ("claimed", "held", "starved", "freed")}
    client = _starving_flask_app(pool, middleware, steps).test_client()
    headers = {"Idempotency-Key": "s1"}
    try:
        with ThreadPoolExecutor(1) as executor:
            answer = executor.submit(client.post, "/pay", json={"intent": "s1", "starve": True},
                                     headers=headers)
            assert steps["claimed"].wait(WAIT_BOUND)
            held = pool.getconn()
            steps["held"].set()
            assert steps["starved"].wait(WAIT_BOUND)
            pool.putconn(held)
            steps["freed"].set()
            first = answer.result(WAIT_BOUND)
        _assert_starved_answer(first.status_code, first.headers, first.data)
        assert _ledger(db) == []
        retry = client.post("/pay", json={"intent": "s1"}, headers=headers)
        assert retry.status_code == 201, retry.data
        _assert_clean(db, pool)
    finally:
        pool.close()
    assert _ledger(db) == ["s1"]


@pytest.mark.anyio
async def test_asgi_handler_without_a_free_connection_answers_503(db: str) -> None:
    """:func:`test_flask_view_without_a_free_connection_answers_503` for the ASGI middleware,
    whose handler catches the PoolTimeout and answers 500 itself."""
    _setup(db)
    pool = AsyncConnectionPool(db, min_size=1, max_size=1, timeout=0.3, open=False)
    steps = {name: asyncio.Event() for name in ("claimed", "held", "starved", "freed")}

    async def pay(request: Request) -> Response:
        op = pg_asgi.get_operation(request)
        assert op is not None
        data = json.loads(await request.body())
        if data.get("starve"):
            steps["claimed"].set()
            await steps["held"].wait()
            try:
                await op.conn.execute("INSERT INTO ledger (intent) VALUES (%s)",
                                      (data["intent"],))
            except Exception:  # noqa: BLE001 - the app's own catch-all
                steps["starved"].set()
                await steps["freed"].wait()
                return Response(b"internal error", status_code=500)
        await op.conn.execute("INSERT INTO ledger (intent) VALUES (%s)", (data["intent"],))
        return Response(_answer(data["intent"]), status_code=201,
                        media_type="application/json")

    app = pg_asgi.IdempotencyMiddleware(
        Starlette(routes=[Route("/pay", pay, methods=["POST"])]), pool=pool,
        scope=lambda r: "acct", routes={"POST /pay": "required"})
    await pool.open(wait=True)
    headers = {"Idempotency-Key": "a1"}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t", timeout=WAIT_BOUND) as client:
            answer = asyncio.create_task(
                client.post("/pay", json={"intent": "a1", "starve": True}, headers=headers))
            await asyncio.wait_for(steps["claimed"].wait(), WAIT_BOUND)
            held = await pool.getconn()
            steps["held"].set()
            await asyncio.wait_for(steps["starved"].wait(), WAIT_BOUND)
            await pool.putconn(held)
            steps["freed"].set()
            first = await answer
            _assert_starved_answer(first.status_code, first.headers, first.content)
            assert _ledger(db) == []
            retry = await client.post("/pay", json={"intent": "a1"}, headers=headers)
            assert retry.status_code == 201, retry.text
        await _await_clean(db, pool)
    finally:
        await pool.close()
    assert _ledger(db) == ["a1"]
