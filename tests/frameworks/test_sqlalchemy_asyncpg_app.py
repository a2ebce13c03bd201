"""docs/sqlalchemy.md's "FastAPI on asyncpg" app, the page's block as written, over HTTP (httpx's
ASGI transport) on a real server: an AsyncSession on postgresql+asyncpg with ``aoperation`` in
the handler, no middleware and no second pool. Concurrent identical requests give one ledger
row and byte-identical answers; another body under the key is 422 and a body FastAPI refuses
claims nothing; a backend killed under the handler's flush is 503, writes nothing, and the
retry pays once."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from helpers import ROOT
from helpers import sa_engines as engines
from sqlalchemy import event

from pgharness import WAIT_BOUND

pytestmark = pytest.mark.anyio

FENCE = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
HEADERS = {"X-Account": "acct_42", "Content-Type": "application/json"}


def page_block() -> str:
    """The page's one Python block that is the asyncpg app."""
    found = [m.group(1) for m in FENCE.finditer((ROOT / "docs" / "sqlalchemy.md").read_text())
             if "postgresql+asyncpg" in m.group(1) and "FastAPI()" in m.group(1)]
    assert len(found) == 1, f"{len(found)} asyncpg app blocks in docs/sqlalchemy.md"
    return found[0]


@asynccontextmanager
async def shop(db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Any]:
    """The page's app as its own module (shop.py), its engine on this test's database."""
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute("CREATE TABLE sa_ledger (id serial PRIMARY KEY, account varchar(64) NOT "
                     "NULL, amount integer NOT NULL, currency varchar(3) NOT NULL)")
    path = tmp_path / "shop.py"
    path.write_text(page_block())
    monkeypatch.setenv("DATABASE_URL", engines.sa_url(db, "asyncpg"))
    spec = importlib.util.spec_from_file_location(f"shop_{tmp_path.name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        assert module.engine.url.drivername == "postgresql+asyncpg"
        yield module
    finally:
        if hasattr(module, "engine"):
            await module.engine.dispose()
        sys.modules.pop(spec.name, None)


def client(app: Any) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://test", timeout=WAIT_BOUND)


def pay(http: httpx.AsyncClient, key: str, body: Any) -> Any:
    return http.post("/payments", content=json.dumps(body),
                     headers={**HEADERS, "Idempotency-Key": key})


def ledger(db: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(db) as conn:
        return conn.execute("SELECT account, amount, currency FROM sa_ledger").fetchall()


def key_states(db: str) -> dict[str, str]:
    with psycopg.connect(db) as conn:
        return dict(conn.execute("SELECT key, state::text FROM idempotency.keys").fetchall())


async def test_concurrent_identical_requests_one_row_byte_identical(
        db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with shop(db, tmp_path, monkeypatch) as app, client(app.app) as http:
        responses = await asyncio.gather(*(pay(http, "order-1", {"amount": 50})
                                           for _ in range(12)))
        statuses = [r.status_code for r in responses]
        assert set(statuses) <= {201, 409}, [(r.status_code, r.text) for r in responses]
        first = [r for r in responses if r.status_code == 201
                 and "idempotent-replayed" not in r.headers]
        assert len(first) == 1, statuses
        assert all(r.headers["retry-after"] for r in responses if r.status_code == 409)
        again = await pay(http, "order-1", {"amount": 50})
        assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true"
        answers = {r.content for r in [*responses, again] if r.status_code == 201}
        assert answers == {first[0].content}
        assert json.loads(first[0].content) == {"id": 1, "amount": 50, "currency": "EUR"}
        assert again.headers["content-type"] == first[0].headers["content-type"]
    assert ledger(db) == [("acct_42", 50, "EUR")]
    assert key_states(db) == {"order-1": "completed"}


async def test_another_body_is_422_and_a_refused_body_claims_nothing(
        db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with shop(db, tmp_path, monkeypatch) as app, client(app.app) as http:
        assert (await pay(http, "order-2", {"amount": 7})).status_code == 201
        other = await pay(http, "order-2", {"amount": 8})
        assert other.status_code == 422 and "another request" in other.text
        refused = await pay(http, "order-3", {"amount": -1})  # FastAPI's validation
        assert refused.status_code == 422
    assert ledger(db) == [("acct_42", 7, "EUR")]
    assert key_states(db) == {"order-2": "completed"}


async def test_backend_killed_under_the_flush_is_503_then_the_retry_pays_once(
        db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with shop(db, tmp_path, monkeypatch) as app, client(app.app) as http:
        kill = {"armed": True}

        def terminate_before_insert(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
            if kill["armed"] and statement.startswith("INSERT INTO sa_ledger"):
                kill["armed"] = False
                pid = conn.connection.driver_connection.get_server_pid()
                with psycopg.connect(db, autocommit=True) as owner:
                    owner.execute("SELECT pg_terminate_backend(%s, 60000)", (pid,))

        event.listen(app.engine.sync_engine, "before_cursor_execute", terminate_before_insert)
        down = await pay(http, "order-4", {"amount": 9})
        assert down.status_code == 503 and down.headers["retry-after"] == "1", down.text
        assert not kill["armed"] and ledger(db) == []
        # the block's exception released the key, on a new connection of the session's pool
        assert key_states(db) == {"order-4": "released"}
        retry = await pay(http, "order-4", {"amount": 9})
        assert retry.status_code == 201 and "idempotent-replayed" not in retry.headers
    assert ledger(db) == [("acct_42", 9, "EUR")]
    assert key_states(db) == {"order-4": "completed"}
