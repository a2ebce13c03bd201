"""examples/fastapi_sqlalchemy over HTTP on real PostgreSQL: FastAPI, SQLAlchemy 2 async ORM
sessions from pg_idempotency.sqlalchemy.request_session, the middleware. One ledger row per key
under concurrent identical requests, a crash after the session's commit, a lease takeover; and
the app's usual session refused while an operation is open."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from typing import Any

import httpx
import psycopg
import pytest
from fastapi import Request
from fastapi.responses import JSONResponse
from helpers.http import ROOT, lifespan, uvicorn_server

from pg_idempotency.asgi import get_operation
from pgharness import WAIT_BOUND, wait_until

pytestmark = pytest.mark.anyio

ACCT = {"X-Account": "acct_42", "Content-Type": "application/json"}


def _load() -> Any:
    path = ROOT / "examples" / "fastapi_sqlalchemy" / "app.py"
    spec = importlib.util.spec_from_file_location("fastapi_sqlalchemy_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # SQLAlchemy resolves Mapped[...] in the module's globals
    spec.loader.exec_module(module)
    return module


example = _load()


def pay(client: httpx.AsyncClient, key: str, body: Any, path: str = "/payments") -> Any:
    content = body if isinstance(body, str) else json.dumps(body)
    return client.post(path, content=content, headers={**ACCT, "Idempotency-Key": key})


def asgi_client(app: Any) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://test", timeout=WAIT_BOUND)


def rows(dsn: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT account, amount FROM sa_ledger ORDER BY id").fetchall()


def key_rows(dsn: str, key: str) -> list[tuple[str, int]]:
    """(state, lease_token) of the key's rows."""
    with psycopg.connect(dsn) as conn:
        return [(r[0], r[1]) for r in conn.execute(
            "SELECT state, lease_token FROM idempotency.keys WHERE key = %s", (key,))]


def lease_ran_out(dsn: str, key: str) -> bool:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT lease_expires_at < clock_timestamp() FROM idempotency.keys"
                           " WHERE key = %s AND state = 'in_progress'", (key,)).fetchone()
    return bool(row and row[0])


def released_token(dsn: str, key: str) -> int:
    """The token of a key release() left for the next claim (one row, state released, no lease
    and no response); fails otherwise."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT state, lease_expires_at, response_status, lease_token "
                            "FROM idempotency.keys WHERE key = %s", (key,)).fetchall()
    assert len(rows) == 1 and rows[0][:3] == ("released", None, None), rows
    return int(rows[0][3])


def test_8_concurrent_identical_requests_over_uvicorn(db: str) -> None:
    app = example.create_app(db, wait=20)
    app.state.faults["delay"] = 0.3  # the first one is slow: the others must wait, not run

    async def fire(base: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base, timeout=WAIT_BOUND) as client:
            return await asyncio.gather(*(pay(client, "same", {"amount": 70})
                                          for _ in range(8)))

    with uvicorn_server(app) as base:
        responses = asyncio.run(fire(base))
    assert [r.status_code for r in responses] == [201] * 8, [r.text for r in responses]
    assert len({r.content for r in responses}) == 1
    assert sum(r.headers.get("idempotent-replayed") == "true" for r in responses) == 7
    assert rows(db) == [("acct_42", 70)]


async def test_crash_after_the_sessions_commit_then_retry(db: str) -> None:
    app = example.create_app(db)
    async with lifespan(app), asgi_client(app) as client:
        app.state.faults["crash_after_commit"] = True
        crashed = await pay(client, "k-crash", {"amount": 20})
        assert crashed.status_code == 500
        assert rows(db) == []  # the session's commit was a savepoint: rolled back
        released = released_token(db, "k-crash")  # released: nothing can have happened
        retry = await pay(client, "k-crash", {"amount": 20})
        assert retry.status_code == 201 and "idempotent-replayed" not in retry.headers
        # the retry claimed it afresh, under a greater token, and completed it
        [(state, token)] = key_rows(db, "k-crash")
        assert state == "completed" and token > released
        again = await pay(client, "k-crash", {"amount": 20})
        assert again.content == retry.content and again.headers["idempotent-replayed"] == "true"
        located = await client.get(retry.headers["location"], headers=ACCT)
        assert located.json() == retry.json()
    assert rows(db) == [("acct_42", 20)]


async def test_lease_takeover_gives_one_row(db: str) -> None:
    app = example.create_app(db, wait=0, lease=0.5)
    async with lifespan(app), asgi_client(app) as client:
        held = asyncio.Event()
        app.state.faults["hold"] = held
        slow = asyncio.ensure_future(pay(client, "k-lease", {"amount": 5}))
        try:
            # the slow one wrote its row and waits; its lease runs out (the server's clock)
            await asyncio.to_thread(wait_until, lambda: "hold" not in app.state.faults
                                    and lease_ran_out(db, "k-lease"), "the lease to run out")
            retry = await pay(client, "k-lease", {"amount": 5})
        finally:
            held.set()
        first = await slow
        assert retry.status_code == 201, retry.text
        assert first.status_code == 409, first.text  # fenced off at complete(): rolled back
        replay = await pay(client, "k-lease", {"amount": 5})
        assert replay.content == retry.content
    assert rows(db) == [("acct_42", 5)]


async def test_validation_error_is_not_stored(db: str) -> None:
    app = example.create_app(db)
    async with lifespan(app), asgi_client(app) as client:
        bad = await pay(client, "k-bad", {"amount": -1})
        assert bad.status_code == 422 and "idempotent-replayed" not in bad.headers
        released = released_token(db, "k-bad")
        fixed = await pay(client, "k-bad", {"amount": 1})
        assert fixed.status_code == 201, fixed.text
        [(state, token)] = key_rows(db, "k-bad")
        assert state == "completed" and token > released
    assert rows(db) == [("acct_42", 1)]


async def test_the_apps_usual_session_is_refused(db: str) -> None:
    """The unsafe pattern of issue 12: a handler writing with the app's usual session. Its
    commit raises ForeignCommitError, so the row never commits and the key is released."""
    app = example.create_app(db, keyed=("POST /payments", "POST /usual"))
    seen: list[str] = []

    @app.post("/usual")
    async def usual(request: Request) -> JSONResponse:
        get_operation(request)
        async with app.state.sessions() as session:
            session.add(example.LedgerEntry(account="acct_42", amount=99, currency="EUR"))
            try:
                await session.commit()
            except Exception as exc:
                seen.append(type(exc).__name__)
                raise
        return JSONResponse({"ok": True}, status_code=201)

    async with lifespan(app), asgi_client(app) as client:
        refused = await pay(client, "k-usual", {"amount": 99}, path="/usual")
        assert refused.status_code == 500
        assert seen == ["ForeignCommitError"]
        assert released_token(db, "k-usual") > 0
        # outside an operation the usual session commits as always
        async with app.state.sessions() as session:
            session.add(example.LedgerEntry(account="acct_7", amount=1, currency="EUR"))
            await session.commit()
    assert rows(db) == [("acct_7", 1)]
