"""A lost connection under pg_idempotency.sqlalchemy (issue 33): the session's backend is
terminated (``pg_terminate_backend`` from another connection, waiting for it to exit) at each
point of an operation, as the request role:

- ``operation()`` on a Session and ``aoperation()`` on an AsyncSession, on every driver of
  helpers.sa_engines (sync: psycopg, psycopg through ``text()``, pg8000; async: psycopg,
  psycopg through ``text()``, asyncpg): lost before an ORM flush in ``op.complete()``, before
  ``complete()`` itself, and under a statement of the block: the block raises
  :class:`pg_idempotency.DatabaseUnavailable` (never SQLAlchemy's error; its ``pgerror`` is
  the driver's own), no business row exists, and the key (claimed before the loss) is
  released on the session's next connection or stays in progress until its lease expires;
  then a retry claims or resumes it and completes once;
- behind the ASGI middleware with a session from ``request_session`` (the
  examples/fastapi_sqlalchemy pattern, FastAPI over real HTTP): lost in the handler's
  ``session.commit()`` or after it (in the middleware's complete): 503 with Retry-After, never
  500, nothing stored; the retry after the lease gets 201 and exactly one row;
- no server on the port (every driver): the claim's refused connection is DatabaseUnavailable.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Annotated, Any

import httpx
import psycopg
import pytest
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from helpers import login_roles
from helpers import sa_engines as engines
from helpers.http import uvicorn_server
from helpers.served import free_port
from psycopg import sql
from psycopg_pool import AsyncConnectionPool
from sqlalchemy import String, select, text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import pg_idempotency as idem
from pg_idempotency import sqlalchemy as pg_sa
from pg_idempotency.asgi import IdempotencyMiddleware
from pg_idempotency.errors import DatabaseUnavailable
from pgharness import WAIT_BOUND, PgServer, wait_until

LEASE = 1.0
#: The handler's session, inside the operation's transaction (as examples/fastapi_sqlalchemy).
OperationSession = Annotated[AsyncSession, Depends(pg_sa.request_session)]


class Base(DeclarativeBase):
    pass


class Entry(Base):
    __tablename__ = "outage_entries"

    id: Mapped[int] = mapped_column(primary_key=True)
    intent: Mapped[str] = mapped_column(String(40))


@pytest.fixture
def role(server: PgServer, db: str) -> Iterator[str]:
    """The request role, with the business table the owner made."""
    with login_roles(server, db, "request") as (name,):
        with psycopg.connect(db, autocommit=True) as owner:
            owner.execute("CREATE TABLE outage_entries (id serial PRIMARY KEY, "
                          "intent varchar(40) NOT NULL)")
            owner.execute(sql.SQL("GRANT SELECT, INSERT ON outage_entries TO {0}; "
                                  "GRANT USAGE ON SEQUENCE outage_entries_id_seq TO {0}").format(
                sql.Identifier(name)))
        yield name


def terminate(db: str, pid: int) -> None:
    """End backend ``pid`` from another connection, and wait (up to 60 s) until it is gone."""
    with psycopg.connect(db, autocommit=True) as owner:
        assert owner.execute("SELECT pg_terminate_backend(%s, 60000)", (pid,)).fetchone() == \
            (True,)


def rows(db: str, intent: str) -> int:
    with psycopg.connect(db) as conn:
        return conn.execute("SELECT count(*) FROM outage_entries "  # type: ignore[index]
                            "WHERE intent = %s", (intent,)).fetchone()[0]


def state(db: str, key: str) -> str | None:
    with psycopg.connect(db) as conn:
        row = conn.execute("SELECT state::text FROM idempotency.keys WHERE key = %s",
                           (key,)).fetchone()
    return None if row is None else row[0]


def wait_for_lease(db: str, key: str) -> None:
    """Until the key's lease has expired by the server's clock (the point of a retry)."""
    with psycopg.connect(db, autocommit=True) as conn:
        wait_until(lambda: conn.execute(
            "SELECT lease_expires_at < clock_timestamp() FROM idempotency.keys WHERE key = %s",
            (key,)).fetchone() == (True,), f"the lease of {key} to expire")


#: What a key claimed before the loss is left as: released when the package's release, on
#: the session's next connection, got through (safe: release is fenced by the lease token, so a
#: complete that did commit cannot be undone), else in progress until its lease expires.
LEFT = ("released", "in_progress")


def retry_until_completed(db: str, key: str) -> None:
    """Wait for the lease of a key left in progress to expire (a retry then resumes it)."""
    if state(db, key) == "in_progress":
        wait_for_lease(db, key)


#: Where the backend is terminated: before the ORM's flush in op.complete(), after the flush
#: (before complete's own statement), or before a statement of the block itself.
POINTS = ["before-flush", "before-complete", "in-block"]


def from_driver(error: BaseException | None, flavour: str) -> bool:
    """Whether ``error`` (DatabaseUnavailable's pgerror) is the flavour's driver's own."""
    return error is not None and \
        type(error).__module__.split(".")[0] == engines.driver(flavour)


@pytest.mark.parametrize("flavour", engines.SYNC)
def test_session_operation_lost_connection_is_database_unavailable(db: str, role: str,
                                                                   flavour: str) -> None:
    engine = engines.engine(db, flavour, connect_args=engines.connect_args(flavour, user=role))
    try:
        for point in POINTS:
            key = f"sync-{point}"
            with engines.statements_path(flavour), Session(engine) as session, \
                    pytest.raises(DatabaseUnavailable) as caught:
                with pg_sa.operation(session, "acct", key, {"k": key}, lease=LEASE) as op:
                    pid = session.execute(text("SELECT pg_backend_pid()")).scalar_one()
                    session.add(Entry(intent=key))
                    if point == "before-complete":
                        session.flush()
                    terminate(db, pid)
                    if point == "in-block":
                        session.execute(select(Entry)).all()
                    op.complete(201, {"ok": True})
            assert from_driver(caught.value.pgerror, flavour), (point, caught.value.pgerror)
            assert rows(db, key) == 0 and state(db, key) in LEFT, point
            retry_until_completed(db, key)
            with engines.statements_path(flavour), Session(engine) as session:
                with pg_sa.operation(session, "acct", key, {"k": key}, lease=LEASE) as op:
                    assert op.outcome in (idem.Outcome.RESUMED, idem.Outcome.CLAIMED)
                    session.add(Entry(intent=key))
                    op.complete(201, {"ok": True})
            assert rows(db, key) == 1 and state(db, key) == "completed", point
    finally:
        engine.dispose()


@pytest.mark.parametrize("flavour", engines.ASYNC)
def test_async_session_operation_lost_connection_is_database_unavailable(
        db: str, role: str, flavour: str) -> None:
    async def run() -> None:
        engine = engines.async_engine(db, flavour,
                                      connect_args=engines.connect_args(flavour, user=role))
        sessions = async_sessionmaker(engine, expire_on_commit=False)
        try:
            for point in POINTS:
                key = f"async-{point}"
                async with sessions() as session:
                    with pytest.raises(DatabaseUnavailable) as caught:
                        async with pg_sa.aoperation(session, "acct", key, {"k": key},
                                                    lease=LEASE) as op:
                            pid = (await session.execute(
                                text("SELECT pg_backend_pid()"))).scalar_one()
                            session.add(Entry(intent=key))
                            if point == "before-complete":
                                await session.flush()
                            await asyncio.to_thread(terminate, db, pid)
                            if point == "in-block":
                                (await session.execute(select(Entry))).all()
                            await op.complete(201, {"ok": True})
                assert from_driver(caught.value.pgerror, flavour), (point, caught.value.pgerror)
                assert rows(db, key) == 0 and state(db, key) in LEFT, point
                retry_until_completed(db, key)
                async with sessions() as session:
                    async with pg_sa.aoperation(session, "acct", key, {"k": key},
                                                lease=LEASE) as op:
                        assert op.outcome in (idem.Outcome.RESUMED, idem.Outcome.CLAIMED)
                        session.add(Entry(intent=key))
                        await op.complete(201, {"ok": True})
                assert rows(db, key) == 1 and state(db, key) == "completed", point
        finally:
            await engine.dispose()

    with engines.statements_path(flavour):
        asyncio.run(run())


# -- behind the ASGI middleware, with request_session (examples/fastapi_sqlalchemy) -----------

def _app(dsn: str, db: str) -> FastAPI:
    pool = AsyncConnectionPool(dsn, min_size=1, max_size=4, open=False)
    faults: dict[str, str] = {}

    async def lifespan(app: FastAPI) -> Any:
        await pool.open()
        yield
        await pool.close()

    app = FastAPI(lifespan=lifespan)
    app.state.faults = faults
    app.add_middleware(IdempotencyMiddleware, pool=pool, lease=LEASE,
                       scope=lambda r: r.headers.get("x-account"),
                       routes={"POST /pay": "required"})

    @app.post("/pay", status_code=201)
    async def pay(request: Request, session: OperationSession) -> JSONResponse:
        intent = (await request.json())["intent"]
        fault = faults.pop(intent, None)
        pid = (await session.execute(text("SELECT pg_backend_pid()"))).scalar_one()
        if fault == "in-commit":  # the handler's own flush meets the lost connection
            await asyncio.to_thread(terminate, db, pid)
        entry = Entry(intent=intent)
        session.add(entry)
        await session.commit()  # a savepoint: the row commits with the stored response
        if fault == "at-complete":  # the middleware's complete meets it
            await asyncio.to_thread(terminate, db, pid)
        return JSONResponse({"id": entry.id}, status_code=201)

    return app


def test_asgi_request_session_lost_connection_is_503(db: str, role: str) -> None:
    dsn = psycopg.conninfo.make_conninfo(db, user=role)
    app = _app(dsn, db)
    with uvicorn_server(app) as base:
        for fault in ("in-commit", "at-complete"):
            app.state.faults[fault] = fault
            headers = {"Idempotency-Key": fault, "X-Account": "acct"}
            r = httpx.post(base + "/pay", json={"intent": fault}, headers=headers,
                           timeout=WAIT_BOUND)
            assert r.status_code == 503, (fault, r.status_code, r.text)
            assert r.headers["retry-after"] == "1"
            assert r.headers["content-type"] == "application/problem+json"
            assert rows(db, fault) == 0 and state(db, fault) in LEFT
            retry_until_completed(db, fault)
            again = httpx.post(base + "/pay", json={"intent": fault}, headers=headers,
                               timeout=WAIT_BOUND)
            assert again.status_code == 201, again.text
            assert rows(db, fault) == 1 and state(db, fault) == "completed"


# -- a database that refuses connections ---------------------------------------------------------

@pytest.mark.parametrize("flavour", sorted({*engines.SYNC, *engines.ASYNC}))
def test_refused_connection_is_database_unavailable(flavour: str) -> None:
    """No server on the port: the claim's connection is refused, and operation() /
    aoperation() raise DatabaseUnavailable (asyncpg's refusal is the OS's own error, which
    SQLAlchemy does not wrap), never the driver's or SQLAlchemy's error."""
    dsn = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"
    if flavour in engines.SYNC:
        engine = engines.engine(dsn, flavour)
        try:
            with engines.statements_path(flavour), Session(engine) as session, \
                    pytest.raises(DatabaseUnavailable) as caught:
                with pg_sa.operation(session, "acct", "k", {"k": 1}):
                    pass
        finally:
            engine.dispose()
        assert isinstance(caught.value.pgerror, Exception), caught.value
    if flavour in engines.ASYNC:
        async def run() -> DatabaseUnavailable:
            engine = engines.async_engine(dsn, flavour)
            try:
                async with AsyncSession(engine) as session:
                    with pytest.raises(DatabaseUnavailable) as caught:
                        async with pg_sa.aoperation(session, "acct", "k", {"k": 1}):
                            pass
                    return caught.value
            finally:
                await engine.dispose()

        with engines.statements_path(flavour):
            assert isinstance(asyncio.run(run()).pgerror, Exception)
