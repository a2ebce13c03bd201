"""The ASGI middleware through HTTP, on real PostgreSQL: the example payments app
(examples/payments/app.py) through httpx's ASGI transport and through a real uvicorn server on
127.0.0.1, and a small app for the failure paths."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import timedelta
from typing import Any

import httpx
import psycopg
import pytest
from helpers.http import ledger_rows, lifespan, payments, uvicorn_server
from psycopg.conninfo import make_conninfo
from psycopg_pool import AsyncConnectionPool
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pg_idempotency import aio
from pg_idempotency.asgi import IdempotencyMiddleware, Policy, get_operation
from pg_idempotency.contract import Settings, request_fingerprint
from pgharness import WAIT_BOUND, wait_until

pytestmark = pytest.mark.anyio

ACCT = {"X-Account": "acct_42"}


def post(client: httpx.AsyncClient, key: str | None, body: Any, **headers: str) -> Any:
    h = dict(ACCT, **headers)
    if key is not None:
        h["Idempotency-Key"] = key
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return client.post("/payments", content=content,
                       headers={"Content-Type": "application/json", **h})


def asgi_client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def test_replay_400_401_422(db: str) -> None:
    processor = payments.FakeProcessor()
    app = payments.create_app(db, processor)
    async with lifespan(app), asgi_client(app) as client:
        missing = await post(client, None, {"amount": 50})
        assert missing.status_code == 400
        assert missing.headers["content-type"] == "application/problem+json"
        assert missing.json()["status"] == 400 and "Idempotency-Key" in missing.json()["title"]
        too_long = await post(client, "k" * 256, {"amount": 50})
        assert too_long.status_code == 400 and "255" in too_long.json()["detail"]
        anonymous = await client.post("/payments", json={"amount": 50},
                                      headers={"Idempotency-Key": "k1"})
        assert anonymous.status_code == 401

        first = await post(client, "k1", {"amount": 50, "currency": "EUR"})
        assert first.status_code == 201, first.text
        assert "idempotent-replayed" not in first.headers and "x-request-id" in first.headers
        # the same request re-serialised (key order, spacing, 50.0 for 50), the key quoted
        again = await post(client, '"k1"', '{"currency":"EUR",  "amount": 50.0}')
        assert again.status_code == 201
        assert again.content == first.content
        assert again.headers["content-type"] == first.headers["content-type"]
        assert again.headers["location"] == first.headers["location"]
        assert again.headers["idempotent-replayed"] == "true"
        assert "x-request-id" not in again.headers  # per-request headers are not replayed

        other = await post(client, "k1", {"amount": 51, "currency": "EUR"})
        assert other.status_code == 422
        assert other.headers["content-type"] == "application/problem+json"
        assert other.json()["status"] == 422

        # the same key from another caller is another key
        theirs = await post(client, "k1", {"amount": 50}, **{"X-Account": "acct_7"})
        assert theirs.status_code == 201 and "idempotent-replayed" not in theirs.headers

        # FastAPI's request validation answers before the handler runs: not stored, the key
        # is released, and the corrected request with the same key is the first attempt
        bad = await post(client, "k2", {"amount": -1})
        assert bad.status_code == 422 and "idempotent-replayed" not in bad.headers
        again_bad = await post(client, "k2", {"amount": -1})
        assert again_bad.status_code == 422 and "idempotent-replayed" not in again_bad.headers
        key_k2 = ("SELECT state, lease_expires_at, response_status, lease_token "
                  "FROM idempotency.keys WHERE key = 'k2'")
        with psycopg.connect(db) as conn:
            [released] = conn.execute(key_k2).fetchall()  # kept for the next claim, released
        assert released[:3] == ("released", None, None)
        fixed = await post(client, "k2", {"amount": 60})
        assert fixed.status_code == 201 and "idempotent-replayed" not in fixed.headers
        with psycopg.connect(db) as conn:  # claimed afresh, under a greater token
            [done] = conn.execute(key_k2).fetchall()
        assert done[:3] == ("completed", None, 201) and done[3] > released[3]

        located = await client.get(first.headers["location"], headers=ACCT)
        assert located.status_code == 200 and located.json() == first.json()
    assert [r[:2] for r in ledger_rows(db)] == [("acct_42", 50), ("acct_7", 50),
                                                ("acct_42", 60)]
    assert processor.calls == 3


async def test_409_with_retry_after_then_replay(db: str) -> None:
    processor = payments.FakeProcessor(delay=1.0)
    app = payments.create_app(db, processor, wait=0)
    async with lifespan(app), asgi_client(app) as client:
        original = asyncio.ensure_future(post(client, "slow", {"amount": 9}))
        await _until_claimed(db, "slow")
        busy = await post(client, "slow", {"amount": 9})
        assert busy.status_code == 409
        assert busy.headers["content-type"] == "application/problem+json"
        # a short hint, not the 30 s left on the lease (retry_after_max, default 2)
        assert busy.headers["retry-after"] == "2"
        first = await original
        assert first.status_code == 201
        replay = await post(client, "slow", {"amount": 9})
        assert (replay.status_code, replay.content) == (201, first.content)
        assert replay.headers["idempotent-replayed"] == "true"
    assert len(ledger_rows(db)) == 1


# DateStyle, IntervalStyle and TimeZone that psycopg's timestamptz and interval loaders cannot
# parse, as a DBA may set them for the application's role (tests/server/test_session_settings.py).
HOSTILE_OPTIONS = "-c DateStyle=SQL,DMY -c IntervalStyle=sql_standard -c TimeZone=Pacific/Chatham"


class GatedProcessor(payments.FakeProcessor):
    """Charge number i (from 0) of the first ``gated`` ones says so (``entered[i]``) and waits
    in the processor until the test opens ``gates[i]``; later charges go through: requests that
    hold their key exactly as long as the test needs, in its order, on a machine of any
    speed."""

    def __init__(self, gated: int = 1) -> None:
        super().__init__()
        self.entered = [asyncio.Event() for _ in range(gated)]
        self.gates = [asyncio.Event() for _ in range(gated)]
        self._charges = 0

    async def charge(self, key: str, amount: int, currency: str) -> str:
        i, self._charges = self._charges, self._charges + 1
        if i < len(self.gates):
            self.entered[i].set()
            await self.gates[i].wait()
        return await super().charge(key, amount, currency)


async def test_409_and_replay_under_hostile_session_settings(db: str) -> None:
    processor = GatedProcessor()
    app = payments.create_app(make_conninfo(db, options=HOSTILE_OPTIONS), processor, wait=0)
    async with lifespan(app), asgi_client(app) as client:
        original = asyncio.ensure_future(post(client, "slow", {"amount": 9}))
        await asyncio.wait_for(processor.entered[0].wait(), WAIT_BOUND)  # it holds the key
        with psycopg.connect(db) as conn:  # the lease went in as 30 s
            assert conn.execute("SELECT lease_expires_at - created_at FROM idempotency.keys "
                                "WHERE key = 'slow'").fetchone() == (timedelta(seconds=30),)
        busy = await post(client, "slow", {"amount": 9})  # reads retry_after (an interval)
        assert busy.status_code == 409 and busy.headers["retry-after"] == "2"
        processor.gates[0].set()
        first = await original
        assert first.status_code == 201, first.text
        replay = await post(client, "slow", {"amount": 9})  # reads completed_at
        assert (replay.status_code, replay.content) == (201, first.content)
        assert replay.headers["idempotent-replayed"] == "true"
    assert len(ledger_rows(db)) == 1 and processor.calls == 1


async def test_lease_lost_while_handling_rolls_back_and_answers_409(db: str) -> None:
    """The first attempt outlives its lease; a retry takes the key over and finishes. The
    first one's complete() is fenced off: its ledger row rolls back, its client gets 409."""
    processor = GatedProcessor(gated=2)
    app = payments.create_app(db, processor, wait=0, lease=0.4)
    async with lifespan(app), asgi_client(app) as client:
        slow = asyncio.ensure_future(post(client, "fenced", {"amount": 5}))
        await asyncio.wait_for(processor.entered[0].wait(), WAIT_BOUND)  # claimed, charging
        await asyncio.sleep(0.6)  # past its 0.4 s lease (later only means more expired)
        retrying = asyncio.ensure_future(post(client, "fenced", {"amount": 5}))
        await asyncio.wait_for(processor.entered[1].wait(), WAIT_BOUND)  # it took the key over
        processor.gates[0].set()  # the first one writes and completes: fenced off
        first = await slow
        processor.gates[1].set()
        retry = await retrying
        assert retry.status_code == 201 and "idempotent-replayed" not in retry.headers
        assert first.status_code == 409 and first.headers["retry-after"] == "1"
        replay = await post(client, "fenced", {"amount": 5})
        assert replay.content == retry.content
    assert len(ledger_rows(db)) == 1
    assert processor.calls == 2 and len(processor.charges) == 1  # one charge downstream


async def test_50_concurrent_identical_posts_asgi(db: str) -> None:
    processor = payments.FakeProcessor(delay=0.3)
    app = payments.create_app(db, processor, wait=20)
    async with lifespan(app), asgi_client(app) as client:
        responses = await asyncio.gather(*(post(client, "same", {"amount": 70})
                                           for _ in range(50)))
    _assert_one_effect(db, processor, responses)


def test_50_concurrent_identical_posts_uvicorn(db: str) -> None:
    processor = payments.FakeProcessor(delay=0.3)
    app = payments.create_app(db, processor, wait=20)

    async def fire(base: str) -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=50)
        async with httpx.AsyncClient(base_url=base, limits=limits, timeout=WAIT_BOUND) as client:
            return await asyncio.gather(*(post(client, "same", {"amount": 70})
                                          for _ in range(50)))

    with uvicorn_server(app) as base:
        responses = asyncio.run(fire(base))
    _assert_one_effect(db, processor, responses)


def _assert_one_effect(db: str, processor: Any, responses: list[httpx.Response]) -> None:
    assert [r.status_code for r in responses] == [201] * 50, [r.text for r in responses]
    assert len({r.content for r in responses}) == 1
    assert sum(r.headers.get("idempotent-replayed") == "true" for r in responses) == 49
    assert len(ledger_rows(db)) == 1
    assert processor.calls == 1


# -- failure paths and route policies, on a small app -----------------------------------------

async def test_failures_release_or_keep_the_key(db: str) -> None:
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute("CREATE TABLE notes (body text)")
    pool = AsyncConnectionPool(db, min_size=1, max_size=4, open=False)

    async def write(request: Request) -> Response:
        op = get_operation(request)
        data = await request.json()
        if op is not None:
            await op.conn.execute("INSERT INTO notes VALUES (%s)", (data["mode"],))
            if data["mode"] == "ambiguous":
                op.derive_key("downstream")
        if data["mode"] in ("raise", "ambiguous"):
            raise RuntimeError("boom")
        if data["mode"] == "503":
            return JSONResponse({"error": "busy"}, status_code=503)
        return JSONResponse({"mode": data["mode"], "keyed": op is not None}, status_code=201)

    app = Starlette(routes=[Route("/w", write, methods=["POST", "GET"]),
                            Route("/opt", write, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, pool=pool, scope=lambda r: "tenant",
                       routes={"POST /w": Policy.REQUIRED, "POST /opt": Policy.OPTIONAL})
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    await pool.open()
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            async def send(path: str, key: str | None, mode: str) -> httpx.Response:
                headers = {"Idempotency-Key": key} if key else {}
                return await client.post(path, json={"mode": mode}, headers=headers)

            # an exception before any side effect: rolled back, released, a new body runs
            assert (await send("/w", "a", "raise")).status_code == 500
            assert (await send("/w", "a", "503")).status_code == 503
            ok = await send("/w", "a", "ok")
            assert ok.status_code == 201 and ok.json() == {"mode": "ok", "keyed": True}
            # after a derived downstream key: rolled back, but the key stays in progress
            assert (await send("/w", "b", "ambiguous")).status_code == 500
            assert (await send("/w", "b", "ambiguous")).status_code == 409
            # optional routes pass through without a key; GET is never looked at
            assert (await send("/opt", None, "ok")).json() == {"mode": "ok", "keyed": False}
            assert (await send("/opt", "c", "ok")).json() == {"mode": "ok", "keyed": True}
            got = await client.request("GET", "/w", json={"mode": "ok"})
            assert got.json()["keyed"] is False
    finally:
        await pool.close()
    with psycopg.connect(db) as conn:
        notes = [r[0] for r in conn.execute("SELECT body FROM notes").fetchall()]
    assert sorted(notes) == ["ok", "ok"]  # the keyed ones; failed attempts rolled back


async def _until_claimed(db: str, key: str) -> None:
    deadline = time.monotonic() + WAIT_BOUND
    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
        while time.monotonic() < deadline:
            cur = await conn.execute("SELECT 1 FROM idempotency.keys WHERE key = %s", (key,))
            if await cur.fetchone():
                return
            await asyncio.sleep(0.01)
    raise AssertionError(f"waited {WAIT_BOUND:g} s in vain for {key} to be claimed")


# -- the defects of issue 12: aborted uploads, options, the pool ------------------------------

def _notes_app(db: str, pool: AsyncConnectionPool, calls: list[Any], barrier: int = 0,
               **options: Any) -> Starlette:
    """POST /n (key required): inserts the JSON body's note on op.conn; status from the body.
    With ``barrier``, a handler asked for a second connection first waits (a bounded time) until
    that many handlers hold their transaction's connection: the connections are taken in the
    order a deadlock needs, whatever the machine's load."""
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS notes (body text)")
    holding: list[int] = []
    all_holding = asyncio.Event()

    async def note(request: Request) -> Response:
        op = get_operation(request)
        assert op is not None
        data = await request.json()
        calls.append(data)
        await op.conn.execute("INSERT INTO notes VALUES (%s)", (data["note"],))
        if data.get("second_connection"):
            if barrier:
                holding.append(1)
                if len(holding) >= barrier:
                    all_holding.set()
                try:
                    await asyncio.wait_for(all_holding.wait(), WAIT_BOUND)
                except TimeoutError:
                    pass  # the assertions below say what happened instead
            async with pool.connection() as other:  # the same pool the middleware holds from
                await other.execute("SELECT pg_sleep(0.05)")
        return JSONResponse({"note": data["note"]}, status_code=int(data.get("status", 201)))

    async def plain(request: Request) -> Response:
        """Never asks for its operation."""
        data = await request.json()
        calls.append(data)
        return JSONResponse({"plain": data["note"]}, status_code=int(data.get("status", 201)))

    app = Starlette(routes=[Route("/n", note, methods=["POST"]),
                            Route("/plain", plain, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, pool=pool, scope=lambda r: "tenant",
                       routes={"POST /n": Policy.REQUIRED, "POST /plain": Policy.OPTIONAL},
                       **options)
    return app


def _notes(db: str) -> list[str]:
    with psycopg.connect(db) as conn:
        return [r[0] for r in conn.execute("SELECT body FROM notes ORDER BY body").fetchall()]


def _keys(db: str) -> int:
    with psycopg.connect(db) as conn:
        row = conn.execute("SELECT count(*) FROM idempotency.keys").fetchone()
        assert row is not None
        return int(row[0])


def test_aborted_upload_is_never_claimed(db: str) -> None:
    """A client sends half of its body and disconnects (raw socket, real uvicorn): no claim,
    the handler never runs; its retry with the whole body and the same key is charged once."""
    import socket
    from urllib.parse import urlsplit

    calls: list[Any] = []
    pool = AsyncConnectionPool(db, min_size=1, max_size=4, open=False)
    app = _notes_app(db, pool, calls)
    received: list[str] = []  # the messages the app received, in order

    async def receive_counted(receive: Any) -> Any:
        message = await receive()
        received.append(message["type"])
        return message

    async def lifespan_app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            message = await receive()
            await pool.open()
            await send({"type": "lifespan.startup.complete"})
            message = await receive()
            assert message["type"] == "lifespan.shutdown"
            await pool.close()
            await send({"type": "lifespan.shutdown.complete"})
            return
        await app(scope, lambda: receive_counted(receive), send)

    body = json.dumps({"note": "paid"}).encode()
    with uvicorn_server(lifespan_app) as base:
        url = urlsplit(base)
        with socket.create_connection((url.hostname, url.port)) as sock:
            sock.sendall(b"POST /n HTTP/1.1\r\nHost: t\r\nIdempotency-Key: up-1\r\n"
                         b"Content-Type: application/json\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:7])
            wait_until(lambda: received, "the app to receive the first part of the body")
        wait_until(lambda: "http.disconnect" in received, "the app to see the disconnect")
        assert calls == [] and _keys(db) == 0
        with httpx.Client(base_url=base, timeout=WAIT_BOUND) as client:
            full = client.post("/n", content=body, headers={
                "Idempotency-Key": "up-1", "Content-Type": "application/json"})
            again = client.post("/n", content=body, headers={
                "Idempotency-Key": "up-1", "Content-Type": "application/json"})
    assert full.status_code == 201 and "idempotent-replayed" not in full.headers
    assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true"
    assert len(calls) == 1 and _notes(db) == ["paid"]


async def test_options_server_errors_query_retry_after(db: str) -> None:
    calls: list[Any] = []
    pool = AsyncConnectionPool(db, min_size=1, max_size=4, open=False)
    stores = _notes_app(db, pool, calls, store_server_errors=True, fingerprint_query=True,
                        retry_after_max=5)
    default = _notes_app(db, pool, calls)
    await pool.open()
    try:
        async with asgi_client(stores) as client:
            def send(key: str, note: str, status: int = 201, query: str = "") -> Any:
                return client.post(f"/n{query}", json={"note": note, "status": status},
                                   headers={"Idempotency-Key": key})

            # store_server_errors: a 503 is the key's result, with its writes
            first = await send("s1", "five-oh-three", 503)
            assert first.status_code == 503 and "idempotent-replayed" not in first.headers
            replay = await send("s1", "five-oh-three", 503)
            assert replay.status_code == 503 and replay.headers["idempotent-replayed"] == "true"
            # fingerprint_query=True: another query string is another request
            assert (await send("q1", "query", query="?page=1")).status_code == 201
            other = await send("q1", "query", query="?page=2")
            assert other.status_code == 422
        async with asgi_client(default) as client:
            # the defaults: 5xx rolled back and released, the query string does not count
            failed = await client.post("/n", json={"note": "rolled-back", "status": 500},
                                       headers={"Idempotency-Key": "d1"})
            assert failed.status_code == 500
            ok = await client.post("/n", json={"note": "d1", "status": 201},
                                   headers={"Idempotency-Key": "d1"})
            assert ok.status_code == 201 and "idempotent-replayed" not in ok.headers
            await client.post("/n?page=1", json={"note": "q2"}, headers={"Idempotency-Key": "q2"})
            same = await client.post("/n?page=2&utm=x", json={"note": "q2"},
                                     headers={"Idempotency-Key": "q2"})
            assert same.status_code == 201 and same.headers["idempotent-replayed"] == "true"
            # a handler that never asked for its operation: an error is taken for one that
            # came before it ran (released), a success is stored and replayed
            for _ in range(2):
                refused = await client.post("/plain", json={"note": "p", "status": 403},
                                            headers={"Idempotency-Key": "p1"})
                assert refused.status_code == 403
                assert "idempotent-replayed" not in refused.headers
            fine = await client.post("/plain", json={"note": "p", "status": 200},
                                     headers={"Idempotency-Key": "p2"})
            replayed = await client.post("/plain", json={"note": "p", "status": 200},
                                         headers={"Idempotency-Key": "p2"})
            assert fine.status_code == 200 and replayed.headers["idempotent-replayed"] == "true"
    finally:
        await pool.close()
    assert _notes(db) == ["d1", "five-oh-three", "q2", "query"]
    assert len(calls) == 8  # s1, q1, d1 twice, q2, p1 twice, p2: no replay ran a handler


async def test_retry_after_is_capped(db: str) -> None:
    """A 409's Retry-After is the lease left capped by retry_after_max (here 5 of 30 s)."""
    calls: list[Any] = []
    pool = AsyncConnectionPool(db, min_size=2, max_size=4, open=False)
    app = _notes_app(db, pool, calls, retry_after_max=5)
    await pool.open()
    try:
        async with await psycopg.AsyncConnection.connect(db) as holder:
            # another attempt holds the key (claimed with the default 30 s lease)
            same_request = request_fingerprint(Settings(), "POST", "/n", "", "application/json",
                                               b'{"note": "x"}')
            claimed = await aio.claim(holder, "tenant", "busy", fingerprint=same_request)
            await holder.commit()
            assert claimed.outcome.owned
        async with asgi_client(app) as client:
            busy = await client.post("/n", json={"note": "x"}, headers={"Idempotency-Key": "busy"})
    finally:
        await pool.close()
    assert busy.status_code == 409 and busy.headers["retry-after"] == "5"
    assert calls == []


async def test_second_connection_from_the_middlewares_pool(db: str) -> None:
    """16 concurrent keyed requests whose handler takes a second connection from the pool the
    middleware holds theirs from (4 connections): with the default pool_reserve=1 all succeed;
    with pool_reserve=0 they deadlock until the pool timeout, and the error says why."""
    calls: list[Any] = []
    # The safe app's pool waits as long as a loaded machine needs; the unsafe one's 1 s
    # timeout is the behaviour under test (its assertion is on the error, not on time).
    safe_pool = AsyncConnectionPool(db, min_size=1, max_size=4, timeout=WAIT_BOUND, open=False)
    pool = AsyncConnectionPool(db, min_size=1, max_size=4, timeout=1, open=False)
    safe = _notes_app(db, safe_pool, calls)
    unsafe = _notes_app(db, pool, calls, barrier=4, pool_reserve=0)
    await safe_pool.open()
    await pool.open()
    try:
        async with asgi_client(safe) as client:
            responses = await asyncio.gather(*(
                client.post("/n", json={"note": f"n{i:02}", "second_connection": True},
                            headers={"Idempotency-Key": f"pool-{i}"}) for i in range(16)))
        assert [r.status_code for r in responses] == [201] * 16
        transport = httpx.ASGITransport(app=unsafe)  # exceptions reach the caller
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            results = await asyncio.gather(*(
                client.post("/n", json={"note": f"x{i}", "second_connection": True},
                            headers={"Idempotency-Key": f"dead-{i}"}) for i in range(4)),
                return_exceptions=True)
    finally:
        await pool.close()
        await safe_pool.close()
    errors = [r for r in results if isinstance(r, BaseException)]
    assert errors and all(type(e).__name__ == "PoolExhausted" for e in errors), results
    assert "pool_reserve" in str(errors[0])
    # A request whose wait began later than the others' (a loaded machine) can get the
    # connection a timed-out one gave back, and then succeed: that one is stored as usual.
    survived = [f"x{i}" for i, r in enumerate(results)
                if not isinstance(r, BaseException) and r.status_code == 201]
    assert len(errors) + len(survived) == 4, results
    # the deadlocked ones rolled back: none of their notes is there
    assert _notes(db) == sorted([f"n{i:02}" for i in range(16)] + survived)
