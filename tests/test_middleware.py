"""The ASGI middleware through HTTP, on real PostgreSQL: the example payments app
(examples/payments/app.py) through httpx's ASGI transport and through a real uvicorn server on
127.0.0.1, and a small app for the failure paths."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from payments_helpers import ledger_rows, lifespan, payments, uvicorn_server
from pg_idempotency.asgi import IdempotencyMiddleware, Policy, get_operation

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

        # a validation error is the handler's answer: stored and replayed like any other
        bad = await post(client, "k2", {"amount": -1})
        assert bad.status_code == 422 and "idempotent-replayed" not in bad.headers
        assert (await post(client, "k2", {"amount": -1})).headers["idempotent-replayed"] == "true"

        located = await client.get(first.headers["location"], headers=ACCT)
        assert located.status_code == 200 and located.json() == first.json()
    assert [r[:2] for r in ledger_rows(db)] == [("acct_42", 50), ("acct_7", 50)]
    assert processor.calls == 2


async def test_409_with_retry_after_then_replay(db: str) -> None:
    processor = payments.FakeProcessor(delay=1.0)
    app = payments.create_app(db, processor, wait=0)
    async with lifespan(app), asgi_client(app) as client:
        original = asyncio.ensure_future(post(client, "slow", {"amount": 9}))
        await _until_claimed(db, "slow")
        busy = await post(client, "slow", {"amount": 9})
        assert busy.status_code == 409
        assert busy.headers["content-type"] == "application/problem+json"
        assert int(busy.headers["retry-after"]) >= 1
        first = await original
        assert first.status_code == 201
        replay = await post(client, "slow", {"amount": 9})
        assert (replay.status_code, replay.content) == (201, first.content)
        assert replay.headers["idempotent-replayed"] == "true"
    assert len(ledger_rows(db)) == 1


async def test_lease_lost_while_handling_rolls_back_and_answers_409(db: str) -> None:
    """The first attempt outlives its lease; a retry takes the key over and finishes. The
    first one's complete() is fenced off: its ledger row rolls back, its client gets 409."""
    processor = payments.FakeProcessor(delay=1.2)
    app = payments.create_app(db, processor, wait=0, lease=0.4)
    async with lifespan(app), asgi_client(app) as client:
        slow = asyncio.ensure_future(post(client, "fenced", {"amount": 5}))
        await _until_claimed(db, "fenced")
        await asyncio.sleep(0.6)
        retry = await post(client, "fenced", {"amount": 5})
        first = await slow
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
        async with httpx.AsyncClient(base_url=base, limits=limits, timeout=30) as client:
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
                       routes={"POST /w": Policy.REQUIRED})
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
    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
        for _ in range(200):
            cur = await conn.execute("SELECT 1 FROM idempotency.keys WHERE key = %s", (key,))
            if await cur.fetchone():
                return
            await asyncio.sleep(0.01)
    raise AssertionError(f"{key} was never claimed")
