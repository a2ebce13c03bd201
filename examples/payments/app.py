"""A payments service: the whole pg_idempotency pattern in one FastAPI app.

    pip install '.[asgi,jobs]' fastapi uvicorn      # in the clone
    pg-idempotency migrate --dsn "$DATABASE_URL"
    DATABASE_URL=... python examples/payments/app.py          # listens on 127.0.0.1:8000

    curl -X POST localhost:8000/payments -H 'X-Account: acct_42' \\
         -H 'Idempotency-Key: order-7f3a' -H 'Content-Type: application/json' \\
         -d '{"amount": 50, "currency": "EUR"}'

POST /payments requires an Idempotency-Key. The middleware claims it and hands the handler a
connection in an open transaction; the handler charges the (fake) processor with a key derived
from the client's, so every retry sends the processor the same key, then writes the ledger row.
The middleware stores the response with complete() in that same transaction and commits: the
ledger row and the replayable answer exist together or not at all. Retries get the stored
answer with Idempotent-Replayed: true; concurrent ones wait for it (up to WAIT seconds).
With captures=True, capture.py adds POST /captures: 202 Accepted now, a worker finishes it.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel, Field

from pg_idempotency.asgi import IdempotencyMiddleware, Policy, get_operation

SCHEMA = """
CREATE TABLE IF NOT EXISTS ledger (
    id bigserial PRIMARY KEY,
    account text NOT NULL,
    amount integer NOT NULL,
    currency text NOT NULL,
    charge_id text NOT NULL UNIQUE,
    created_at timestamptz NOT NULL DEFAULT now()
)
"""
WAIT = 10.0  # seconds a retry waits for the original to finish before a 409


class FakeProcessor:
    """A downstream processor that, like real ones, is idempotent on the key it is sent."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.charges: dict[str, dict[str, Any]] = {}
        self.calls = 0

    async def charge(self, key: str, amount: int, currency: str) -> str:
        self.calls += 1
        await asyncio.sleep(self.delay)
        charge = self.charges.setdefault(
            key, {"id": f"ch_{uuid.uuid4().hex[:12]}", "amount": amount, "currency": currency})
        return charge["id"]


class Payment(BaseModel):
    amount: int = Field(gt=0)
    currency: str = Field(default="EUR", pattern="^[A-Z]{3}$")


def caller_account(request: Request) -> str | None:
    """Whose keys these are. A real service takes it from authentication (an API key or token
    lookup), never from a client-chosen value alone; this demo trusts X-Account."""
    return request.headers.get("x-account")


def load_captures() -> Any:
    """capture.py beside this file (in the wheel: _payments_example_capture.py)."""
    here, name = os.path.splitext(__file__)[0], "capture.py"
    path = os.path.join(os.path.dirname(here), name) if here.endswith("app") else here + "_" + name
    spec = importlib.util.spec_from_file_location("payments_capture", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def create_app(dsn: str, processor: FakeProcessor | None = None, wait: float = WAIT,
               lease: float = 30.0, pool_size: int = 10, captures: bool = False,
               capture_processor: Any = None) -> FastAPI:
    pool = AsyncConnectionPool(dsn, min_size=2, max_size=pool_size, open=False)
    processor = processor or FakeProcessor()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await pool.open()
        async with pool.connection() as conn:
            await conn.execute(SCHEMA)
        if worker:
            await worker.start()
        yield
        if worker:
            await worker.stop()
        await pool.close()

    app = FastAPI(title="payments", lifespan=lifespan)
    app.state.processor = processor
    app.add_middleware(IdempotencyMiddleware, pool=pool, scope=caller_account, wait=wait,
                       lease=lease, routes={"POST /payments": Policy.REQUIRED,
                                            "POST /captures": Policy.REQUIRED})
    capture = load_captures() if captures else None
    worker = capture.mount(app, pool, dsn, caller_account, capture_processor) if capture else None

    @app.post("/payments", status_code=201)
    async def create_payment(payment: Payment, request: Request) -> JSONResponse:
        op = get_operation(request)  # never None: the route requires the key
        assert op is not None
        # The processor's key is derived from ours: a retry charges nothing twice.
        charge_id = await processor.charge(op.derive_key("charge"), payment.amount,
                                           payment.currency)
        cur = await op.conn.execute(
            "INSERT INTO ledger (account, amount, currency, charge_id)"
            " VALUES (%s, %s, %s, %s) RETURNING id",
            (op.scope, payment.amount, payment.currency, charge_id))
        (payment_id,) = await cur.fetchone()
        body = {"id": payment_id, "charge_id": charge_id, "amount": payment.amount,
                "currency": payment.currency}
        # Location describes the result and is replayed; X-Request-Id is this request's own.
        return JSONResponse(body, status_code=201, headers={
            "Location": f"/payments/{payment_id}", "X-Request-Id": uuid.uuid4().hex})

    @app.get("/payments/{payment_id}")
    async def get_payment(payment_id: int, request: Request) -> dict[str, Any]:
        async with pool.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(
                "SELECT id, charge_id, amount, currency FROM ledger"
                " WHERE id = %s AND account = %s", (payment_id, caller_account(request)))
            row = await cur.fetchone()
        if row is None:
            raise HTTPException(404, "no such payment")
        return row

    return app


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(create_app(os.environ["DATABASE_URL"], captures=True), host="127.0.0.1", port=8000)
