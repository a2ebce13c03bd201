"""Payments with FastAPI and SQLAlchemy 2 async sessions: the ORM's writes and the stored
response commit together, through pg_idempotency's middleware.

    pip install '.[asgi,sqlalchemy,binary]' fastapi uvicorn     # in the clone
    pg-idempotency migrate --dsn "$OWNER_URL"     # as the schema owner, who makes the table
                                                  # and the application's role: docs/sqlalchemy.md
    DATABASE_URL=postgresql://... python examples/fastapi_sqlalchemy/app.py   # 127.0.0.1:8001

    curl -X POST localhost:8001/payments -H 'X-Account: acct_42' \\
         -H 'Idempotency-Key: order-7f3a' -H 'Content-Type: application/json' \\
         -d '{"amount": 50, "currency": "EUR"}'

The handler takes its session from ``request_session`` (a FastAPI dependency), not from the
app's usual sessionmaker: that session runs in the operation's transaction on the connection
the middleware claimed the key with, so ``session.commit()`` only releases a savepoint, and the
ledger row commits with the stored response when the middleware completes the key. A crash
after ``session.commit()`` rolls the row back and releases the key; a lease takeover fences
the slow attempt off. Reads elsewhere use the app's usual engine and sessions.

``app.state.faults`` lets the tests inject failures, each once: ``"crash_after_commit"`` (raise
after the session's commit), ``"delay"`` (seconds to sleep after it) and ``"hold"`` (an
``asyncio.Event`` to wait for after it, so a test can make the request outlive its lease).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel, Field
from sqlalchemy import String, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from pg_idempotency.asgi import IdempotencyMiddleware, Policy
from pg_idempotency.sqlalchemy import request_session

#: The handler's session: inside the operation's transaction (see the module docstring).
OperationSession = Annotated[AsyncSession, Depends(request_session)]


class Base(DeclarativeBase):
    pass


class LedgerEntry(Base):
    __tablename__ = "sa_ledger"

    id: Mapped[int] = mapped_column(primary_key=True)
    account: Mapped[str] = mapped_column(String(64))
    amount: Mapped[int]
    currency: Mapped[str] = mapped_column(String(3))


class Payment(BaseModel):
    # strict: true is not 1; lt: the column is an integer (a larger amount was a 500).
    amount: int = Field(gt=0, lt=2**31, strict=True)
    currency: str = Field(default="EUR", pattern="^[A-Z]{3}$")


def caller_account(request: Request) -> str | None:
    """Whose keys these are. A real service takes it from authentication, never from a
    client-chosen value alone; this example trusts X-Account."""
    return request.headers.get("x-account")


def sqlalchemy_url(dsn: str) -> str:
    """postgresql://... (libpq URI) as SQLAlchemy's psycopg 3 dialect spells it."""
    return "postgresql+psycopg://" + dsn.split("://", 1)[1]


def create_app(dsn: str, *, wait: float = 10.0, lease: float = 30.0, pool_size: int = 10,
               keyed: tuple[str, ...] = ("POST /payments",)) -> FastAPI:
    """``keyed``: the routes that require an Idempotency-Key (only named routes are keyed)."""
    pool = AsyncConnectionPool(dsn, min_size=1, max_size=pool_size, open=False)
    engine = create_async_engine(sqlalchemy_url(dsn), pool_size=2)  # the app's usual engine
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    faults: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await pool.open()
        async with engine.begin() as conn:
            await conn.run_sync(Base.metadata.create_all)
        yield
        await pool.close()
        await engine.dispose()

    app = FastAPI(title="payments (SQLAlchemy)", lifespan=lifespan)
    app.state.faults = faults
    app.state.sessions = sessions
    app.add_middleware(IdempotencyMiddleware, pool=pool, scope=caller_account, wait=wait,
                       lease=lease, routes=dict.fromkeys(keyed, Policy.REQUIRED))

    @app.post("/payments", status_code=201)
    async def create_payment(payment: Payment, request: Request,
                             session: OperationSession) -> JSONResponse:
        delay, crash = faults.pop("delay", 0), faults.pop("crash_after_commit", False)
        entry = LedgerEntry(account=caller_account(request), amount=payment.amount,
                            currency=payment.currency)
        session.add(entry)
        await session.commit()  # a savepoint: the row commits with the stored response
        await asyncio.sleep(delay)
        if (hold := faults.pop("hold", None)) is not None:
            await hold.wait()
        if crash:
            raise RuntimeError("crash after the session's commit")
        return JSONResponse({"id": entry.id, "amount": entry.amount, "currency": entry.currency},
                            status_code=201, headers={"Location": f"/payments/{entry.id}"})

    @app.get("/payments/{payment_id}")
    async def get_payment(payment_id: int, request: Request) -> dict[str, Any]:
        async with sessions() as session:  # no key here: the app's usual session
            entry = await session.scalar(select(LedgerEntry).where(
                LedgerEntry.id == payment_id, LedgerEntry.account == caller_account(request)))
        if entry is None:
            raise HTTPException(404, "no such payment")
        return {"id": entry.id, "amount": entry.amount, "currency": entry.currency}

    return app


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(create_app(os.environ["DATABASE_URL"]), host="127.0.0.1",
                port=int(os.environ.get("PORT", "8001")))
