"""Slow captures: answer 202 Accepted now, capture in a worker (pg_idempotency.jobs, pgmq).

Mounted by app.py (``create_app(dsn, captures=True)``; needs ``pg-idempotency[jobs]``):

    curl -X POST localhost:8000/captures -H 'X-Account: acct_42' \\
         -H 'Idempotency-Key: cap-1' -H 'Content-Type: application/json' -d '{"amount": 50}'
    curl localhost:8000/captures/cap-1 -H 'X-Account: acct_42'

POST /captures writes a pending row, enqueues the job and stores the 202 with op.accept(), all
in one transaction: a crash leaves neither the job nor the 202. Retries while the worker runs
get that same 202 (same body, same Location) replayed, and never a second job. The worker
captures with a key derived from the client's, marks the row captured and completes the key
in one transaction; retries then get its final answer. GET /captures/{key} is the status URL.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import psycopg
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import Response
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel, Field

from pg_idempotency import derive_key, jobs
from pg_idempotency.asgi import Policy, get_operation

QUEUE = "captures"
ROUTES = {"POST /captures": Policy.REQUIRED}
SCHEMA = """
CREATE TABLE IF NOT EXISTS captures (
    account text NOT NULL,
    key text NOT NULL,
    amount integer NOT NULL,
    currency text NOT NULL,
    state text NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'captured')),
    capture_id text,
    PRIMARY KEY (account, key)
)
"""


class SlowProcessor:
    """A processor whose captures take a while, idempotent on the key it is sent. ``gate``
    (a threading.Event), when set up, holds each capture until it is set (for tests)."""

    def __init__(self, delay: float = 2.0, gate: threading.Event | None = None) -> None:
        self.delay = delay
        self.gate = gate
        self.started = threading.Event()
        self.captures: dict[str, str] = {}
        self.calls = 0

    def capture(self, key: str, amount: int) -> str:
        self.calls += 1
        self.started.set()
        if self.gate is not None:
            self.gate.wait(60)
        else:
            time.sleep(self.delay)
        return self.captures.setdefault(key, f"cap_{uuid.uuid4().hex[:12]}")


class Capture(BaseModel):
    amount: int = Field(gt=0)
    currency: str = Field(default="EUR", pattern="^[A-Z]{3}$")


def status_url(key: str) -> str:
    return f"/captures/{quote(key, safe='')}"


class Captures:
    """The routes' state and the worker thread (started and stopped by the app's lifespan)."""

    def __init__(self, dsn: str, processor: SlowProcessor, lease: float) -> None:
        self.dsn = dsn
        self.processor = processor
        self.lease = lease
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    async def start(self) -> None:
        await asyncio.to_thread(self._setup)
        self._thread = threading.Thread(target=self._work, name="capture-worker", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    def _setup(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            jobs.install_pgmq(conn)
            jobs.create_queue(conn, QUEUE)
            conn.execute(SCHEMA)

    def _work(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn, \
                psycopg.connect(self.dsn, autocommit=True) as heartbeat_conn:
            worker = jobs.Worker(conn, heartbeat_conn, QUEUE, self.run_job, lease=self.lease)
            while not self._stop.is_set():
                if not worker.run_once():
                    self._stop.wait(0.05)

    def run_job(self, job: jobs.Job) -> tuple[Any, ...]:
        """The capture, in the transaction that completes the key."""
        amount, currency = job.payload["amount"], job.payload["currency"]
        capture_id = self.processor.capture(derive_key(job.scope, job.key, "capture"), amount)
        job.conn.execute("UPDATE captures SET state = 'captured', capture_id = %s"
                         " WHERE account = %s AND key = %s", (capture_id, job.scope, job.key))
        return 200, {"state": "captured", "amount": amount, "currency": currency,
                     "capture_id": capture_id}, {"Location": status_url(job.key)}


def mount(app: FastAPI, pool: AsyncConnectionPool, dsn: str,
          caller: Callable[[Request], str | None], processor: SlowProcessor | None = None,
          lease: float = 30.0) -> Captures:
    captures = Captures(dsn, processor or SlowProcessor(), lease)

    @app.post("/captures", status_code=202)
    async def create_capture(capture: Capture, request: Request) -> Response:
        op = get_operation(request)  # never None: the route requires the key
        assert op is not None
        await op.conn.execute(
            "INSERT INTO captures (account, key, amount, currency) VALUES (%s, %s, %s, %s)",
            (op.scope, op.key, capture.amount, capture.currency))
        await jobs.aenqueue(op.conn, QUEUE, op, capture.model_dump())
        url = status_url(op.key)
        # Commits the row, the job and the 202 together; the worker completes the key later.
        stored = await op.accept(202, {"state": "pending", "status_url": url},
                                 headers={"Location": url}, lease=lease)
        # The middleware sends the stored answer itself (this one only says what it is).
        return Response(stored.content, 202, media_type="application/json")

    @app.get("/captures/{key}")
    async def get_capture(key: str, request: Request) -> dict[str, Any]:
        async with pool.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(
                "SELECT key, state, amount, currency, capture_id FROM captures"
                " WHERE account = %s AND key = %s", (caller(request), key))
            row = await cur.fetchone()
        if row is None:
            raise HTTPException(404, "no such capture")
        return row

    return captures
