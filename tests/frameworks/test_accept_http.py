"""Long-running operations over HTTP: the middleware's 202 hand-off (op.accept in the handler),
through httpx's ASGI transport on real PostgreSQL.

The example's slow capture (examples/payments/capture.py, a pgmq worker thread) and a small
app of its own run on both servers: pgmq's SQL-only install works on PostgreSQL 15 and 18.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import httpx
import psycopg
import pytest
from helpers.http import lifespan, payments
from psycopg_pool import AsyncConnectionPool
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from pg_idempotency.asgi import IdempotencyMiddleware, get_operation
from pgharness import WAIT_BOUND

pytestmark = pytest.mark.anyio

ACCT = {"X-Account": "acct_42"}
capture = payments.load_captures()


def asgi_client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def post_capture(client: httpx.AsyncClient, key: str, body: str) -> Any:
    return client.post("/captures", content=body, headers={
        **ACCT, "Idempotency-Key": key, "Content-Type": "application/json"})


def one(dsn: str, query: str) -> Any:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(query).fetchone()
        assert row is not None
        return row[0]


async def test_retries_get_the_same_202_then_the_workers_result(db: str) -> None:
    gate = threading.Event()  # holds the worker's capture until the retries are done
    processor = capture.SlowProcessor(gate=gate)
    app = payments.create_app(db, captures=True, capture_processor=processor)
    try:
        async with lifespan(app), asgi_client(app) as client:
            first = await post_capture(client, "cap-1", '{"amount": 50, "currency": "EUR"}')
            assert first.status_code == 202, first.text
            assert first.json() == {"state": "pending", "status_url": "/captures/cap-1"}
            assert first.headers["location"] == "/captures/cap-1"
            assert "idempotent-replayed" not in first.headers
            assert await asyncio.to_thread(processor.started.wait, 10)  # the job is running

            status = await client.get(first.json()["status_url"], headers=ACCT)
            assert status.status_code == 200 and status.json()["state"] == "pending"

            # 20 retries at once while the job runs, the request re-serialised (key order,
            # spacing): the same 202, byte for byte, and no second job.
            retries = await asyncio.gather(*[
                post_capture(client, "cap-1", '{"currency":"EUR","amount":50}')
                for _ in range(20)])
            for retry in retries:
                assert retry.status_code == 202, retry.text
                assert retry.content == first.content
                assert retry.headers["location"] == first.headers["location"]
                assert retry.headers["content-type"] == first.headers["content-type"]
                assert retry.headers["idempotent-replayed"] == "true"
            assert processor.calls == 1

            gate.set()
            deadline = time.monotonic() + WAIT_BOUND
            while status.json()["state"] != "captured":
                assert time.monotonic() < deadline, "the worker never finished"
                await asyncio.sleep(0.05)
                status = await client.get("/captures/cap-1", headers=ACCT)

            final = await post_capture(client, "cap-1", '{"amount": 50, "currency": "EUR"}')
            assert final.status_code == 200, final.text
            assert final.headers["idempotent-replayed"] == "true"
            assert final.headers["location"] == "/captures/cap-1"
            result = final.json()
            assert result["state"] == "captured" and result["amount"] == 50
            assert status.json()["capture_id"] == result["capture_id"]
            again = await post_capture(client, "cap-1", '{"amount": 50, "currency": "EUR"}')
            assert again.content == final.content

            # other callers cannot see the capture
            theirs = await client.get("/captures/cap-1", headers={"X-Account": "acct_7"})
            assert theirs.status_code == 404
    finally:
        gate.set()
    assert processor.calls == 1  # executed once
    assert one(db, "SELECT total_messages FROM pgmq.metrics('captures')") == 1  # enqueued once
    assert one(db, "SELECT count(*) FROM pgmq.q_captures") == 0  # deleted with the completion
    assert one(db, "SELECT count(*) FROM captures") == 1


async def test_the_first_202_is_the_stored_one(db: str) -> None:
    """accept() stores jsonb: the first answer is sent from that stored form (key order,
    numbers), not from the handler's own bytes, so it equals its replays exactly."""
    calls = []

    async def accept(request: Request) -> JSONResponse:
        op = get_operation(request)
        assert op is not None
        calls.append(op.key)
        # jsonb orders keys by length: "id" comes before "status_url" when stored
        await op.accept(202, {"status_url": "/jobs/j1", "id": 1.50},
                        headers={"Location": "/jobs/j1"})
        return JSONResponse({"something": "else"}, status_code=202,
                            headers={"X-Request-Id": "r1"})

    inner = Starlette(routes=[Route("/jobs", accept, methods=["POST"])])
    async with AsyncConnectionPool(db, min_size=1, max_size=2, open=False) as pool:
        app = IdempotencyMiddleware(inner, pool=pool, scope=lambda request: "acct",
                                    routes={"POST /jobs": "required"})
        async with asgi_client(app) as client:
            answers = [await client.post("/jobs", json={"n": 1},
                                         headers={"Idempotency-Key": "j1"}) for _ in range(3)]
    assert calls == ["j1"]
    first, *replays = answers
    assert first.status_code == 202 and json.loads(first.content) == {"id": 1.50,
                                                                      "status_url": "/jobs/j1"}
    assert first.headers["location"] == "/jobs/j1"
    assert "idempotent-replayed" not in first.headers
    for replay in replays:
        assert (replay.status_code, replay.content) == (202, first.content)
        assert replay.headers["location"] == first.headers["location"]
        assert replay.headers["idempotent-replayed"] == "true"
    assert one(db, "SELECT state FROM idempotency.keys WHERE key = 'j1'") == "in_progress"
