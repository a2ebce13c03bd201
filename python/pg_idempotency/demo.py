"""``pg-idempotency demo``: the payments example under a retry storm, protected and not.

The example service (examples/payments/app.py, shipped in the wheel as
``pg_idempotency._payments_example``) is served by uvicorn on 127.0.0.1 beside an unprotected
twin of its ``POST /payments`` (the same handler without the middleware: every request is a
new charge). Both get the same storm from the retrying client (:mod:`pg_idempotency.client`):
``clients`` concurrent clients, ``payments`` payments each, one fault drawn per payment from
``random.Random(seed)``:

- ``drop``: the first answer is lost after the server committed (the client's transport reads
  it, throws it away and reports a broken connection);
- ``timeout``: the first attempt makes the server slow (``SLOW`` s) and the client gives up on
  it after ``CLIENT_TIMEOUT`` s, while the server goes on working;
- ``double``: the payment is submitted twice at once, with the same key;
- ``kill``: the worker dies right after the processor charged (before the ledger write): its
  transaction rolls back, the client gets a 502 as from a proxy, the key stays in progress
  until its lease (``LEASE`` s) expires, then a retry resumes it and charges the processor
  again with the same derived key, which the processor deduplicates;
- ``reuse``: after the payment, the same key is sent again with another amount (a client bug).

Everything the summary calls a duplicate or a lost payment is counted in the database: the
intents the clients recorded before their first attempt, the processor's charges (deduplicated
on the key it is sent) and the ledger rows.
"""

from __future__ import annotations

import asyncio
import builtins
import contextvars
import json
import random
import socket
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import psycopg
import uvicorn
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

# examples/payments/app.py, which the wheel ships as this module (pyproject.toml)
from . import _payments_example as payments  # type: ignore[attr-defined, unused-ignore]
from .client import AsyncRetryingClient
from .migrate import migrate

FAULTS = ("drop", "timeout", "double", "kill", "reuse")
FAULT_RATE = 0.5  # share of payments with a fault (each kind at least once when there is room)
LEASE = 2.0  # seconds a worker owns a key: how long a killed worker's key stays blocked
WAIT = 0.5  # seconds the middleware waits for an attempt in progress before answering 409
SLOW = 1.0  # seconds the processor takes on a "timeout" attempt (under LEASE)
CLIENT_TIMEOUT = 0.3  # seconds the client waits for that attempt
PROCESSOR_DELAY = 0.02  # every charge: so that double submits really overlap
SCHEMA = "idempotency_demo"  # the demo's tables; the idempotency schema is the real one
SIDES = ("protected", "unprotected")
PATHS = {"protected": "/payments", "unprotected": "/unprotected/payments"}

TABLES = f"""
CREATE SCHEMA IF NOT EXISTS {SCHEMA};
CREATE TABLE IF NOT EXISTS {SCHEMA}.intents (
    run text NOT NULL,
    side text NOT NULL,
    account text NOT NULL,
    key text NOT NULL,
    amount integer NOT NULL,
    fault text NOT NULL,
    PRIMARY KEY (account, key)
);
CREATE TABLE IF NOT EXISTS {SCHEMA}.charges (
    processor_key text PRIMARY KEY,
    account text NOT NULL,
    amount integer NOT NULL,
    currency text NOT NULL,
    charge_id text NOT NULL UNIQUE,
    created_at timestamptz NOT NULL DEFAULT now()
);
"""

# Per side, all from the database. An intent is charged/booked when a charge/ledger row has
# its account and amount (amounts are unique within an account; a reused key's other amount
# matches no intent, so its charge counts as a duplicate).
SUMMARY = f"""
WITH i AS (SELECT account, amount FROM {SCHEMA}.intents WHERE run = %(run)s AND side = %(side)s),
     c AS (SELECT account, amount FROM {SCHEMA}.charges
           WHERE account IN (SELECT account FROM i)),
     l AS (SELECT account, amount FROM ledger WHERE account IN (SELECT account FROM i))
SELECT (SELECT count(*) FROM i) AS intents,
       (SELECT count(*) FROM c) AS charges,
       (SELECT count(*) FROM i WHERE (account, amount) IN (SELECT * FROM c)) AS charged,
       (SELECT count(*) FROM l) AS ledger_rows,
       (SELECT count(*) FROM i WHERE (account, amount) IN (SELECT * FROM l)) AS booked,
       (SELECT coalesce(sum(attempts - 1), 0) FROM idempotency.keys
        WHERE scope IN (SELECT account FROM i)) AS resumed
"""


# -- the fault schedule -----------------------------------------------------------------------

@dataclass(frozen=True)
class Intent:
    client: int
    seq: int
    amount: int
    fault: str  # one of FAULTS, or "none"


def schedule(clients: int, payments_each: int, seed: int) -> list[list[Intent]]:
    """Each client's payments with their faults: a function of the arguments only."""
    rng = random.Random(seed)
    total = clients * payments_each
    faults = ["none"] * total
    for i in range(total):
        if rng.random() < FAULT_RATE:
            faults[i] = rng.choice(FAULTS)
    for i, kind in zip(rng.sample(range(total), min(total, len(FAULTS))), FAULTS,
                       strict=False):
        faults[i] = kind  # every kind at least once, even in a small storm
    return [[Intent(c, s, 100 * (s + 1), faults[c * payments_each + s])
             for s in range(payments_each)] for c in range(clients)]


# -- the server side --------------------------------------------------------------------------

class WorkerKilled(BaseException):
    """The worker dies (a BaseException: no handler of the app answers it)."""


@dataclass
class RequestFault:
    kind: str
    account: str


FAULT: contextvars.ContextVar[RequestFault] = contextvars.ContextVar("demo_fault")


class DemoProcessor(payments.FakeProcessor):
    """The example's processor with its books in the database (table ``charges``), still
    idempotent on the key it is sent, and the faults of the current request."""

    def __init__(self, pool: AsyncConnectionPool) -> None:
        super().__init__(delay=PROCESSOR_DELAY)
        self.pool = pool

    async def charge(self, key: str, amount: int, currency: str) -> str:
        self.calls += 1
        fault = FAULT.get()
        await asyncio.sleep(self.delay + (SLOW if fault.kind == "timeout" else 0))
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                f"INSERT INTO {SCHEMA}.charges (processor_key, account, amount, currency,"
                " charge_id) VALUES (%s, %s, %s, %s, %s)"
                " ON CONFLICT (processor_key) DO NOTHING",
                (key, fault.account, amount, currency, f"ch_{uuid.uuid4().hex[:12]}"))
            cur = await conn.execute(
                f"SELECT charge_id FROM {SCHEMA}.charges WHERE processor_key = %s", (key,))
            row = await cur.fetchone()
            assert row is not None  # inserted above, or by the first attempt
            charge_id: str = row[0]
        if fault.kind == "kill":
            raise WorkerKilled  # charged, and the worker never hears back
        return charge_id


def unprotected_app(pool: AsyncConnectionPool, processor: DemoProcessor) -> Starlette:
    """The example's POST /payments without the middleware: each request charges anew."""

    async def create_payment(request: Request) -> JSONResponse:
        payment = payments.Payment.model_validate_json(await request.body())
        account = payments.caller_account(request)
        charge_id = await processor.charge(str(uuid.uuid4()), payment.amount, payment.currency)
        async with pool.connection() as conn:
            cur = await conn.execute(
                "INSERT INTO ledger (account, amount, currency, charge_id)"
                " VALUES (%s, %s, %s, %s) RETURNING id",
                (account, payment.amount, payment.currency, charge_id))
            (payment_id,) = await cur.fetchone()  # type: ignore[misc]
        return JSONResponse({"id": payment_id, "charge_id": charge_id, "amount": payment.amount,
                             "currency": payment.currency}, status_code=201)

    return Starlette(routes=[Route(PATHS["unprotected"], create_payment, methods=["POST"])])


@dataclass
class ServerStats:
    """What the server answered, per side."""

    attempts: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    replays: int = 0
    killed: int = 0


_GROUP = getattr(builtins, "BaseExceptionGroup", ())


def _killed(exc: BaseException) -> bool:
    if isinstance(exc, WorkerKilled):
        return True
    return bool(_GROUP) and isinstance(exc, _GROUP) and all(
        _killed(e) for e in exc.exceptions)


class Front:
    """The ASGI app uvicorn serves: routes a request to its side, counts the answers, applies
    the request's fault (header X-Demo-Fault) and answers 502 for a killed worker."""

    def __init__(self, protected: Any, unprotected: Any) -> None:
        self.apps = {"protected": protected, "unprotected": unprotected}
        self.stats = {side: ServerStats() for side in SIDES}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        side = "unprotected" if scope["path"] == PATHS["unprotected"] else "protected"
        stats = self.stats[side]
        stats.attempts += 1
        headers = dict(scope["headers"])
        token = FAULT.set(RequestFault(headers.get(b"x-demo-fault", b"").decode(),
                                       headers.get(b"x-account", b"").decode()))

        async def counted(message: Any) -> None:
            if message["type"] == "http.response.start":
                stats.statuses[message["status"]] += 1
                stats.replays += (b"idempotent-replayed", b"true") in message.get("headers", [])
            await send(message)

        try:
            await self.apps[side](scope, receive, counted)
        except BaseException as exc:
            if not _killed(exc):
                raise
            stats.killed += 1
            await counted({"type": "http.response.start", "status": 502,
                           "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
        finally:
            FAULT.reset(token)


# -- the client side --------------------------------------------------------------------------

class FaultTransport(httpx.AsyncBaseTransport):
    """Applies each payment's fault to the first attempt of its key."""

    def __init__(self, inner: httpx.AsyncBaseTransport, plans: dict[str, str]) -> None:
        self.inner = inner
        self.plans = plans
        self.sent: Counter[str] = Counter()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        key = request.headers.get("idempotency-key", "")
        self.sent[key] += 1
        fault = self.plans.get(key, "none") if self.sent[key] == 1 else "none"
        if fault in ("timeout", "kill"):
            request.headers["X-Demo-Fault"] = fault
        if fault == "timeout":
            timeouts = dict(request.extensions.get("timeout", {}))
            timeouts["read"] = CLIENT_TIMEOUT
            request.extensions = {**request.extensions, "timeout": timeouts}
        response = await self.inner.handle_async_request(request)
        if fault == "drop":
            await response.aread()
            await response.aclose()
            raise httpx.ReadError("demo fault: the answer was lost", request=request)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


@dataclass
class SideResult:
    seconds: float = 0.0
    answers: Counter[int] = field(default_factory=Counter)  # the final answer of each request
    gave_up: int = 0  # requests that ended on a transport error


async def storm(dsn: str, plan: list[list[Intent]], run: str, *, progress: bool,
                console: Console) -> dict[str, Any]:
    demo_dsn = _with_search_path(dsn)
    clients = len(plan)
    size = min(4 + 2 * clients, 30)
    side_pool = AsyncConnectionPool(demo_dsn, min_size=1, max_size=size, open=False)
    processor_pool = AsyncConnectionPool(demo_dsn, min_size=1, max_size=4, open=False)
    processors = {side: DemoProcessor(processor_pool) for side in SIDES}
    protected = payments.create_app(demo_dsn, processors["protected"], wait=WAIT, lease=LEASE,
                                    pool_size=size)
    front = Front(protected, unprotected_app(side_pool, processors["unprotected"]))

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(front, lifespan="off", log_level="error",
                                           access_log=False))
    results = {side: SideResult() for side in SIDES}
    plans: dict[str, str] = {}

    async def one_client(side: str, http: httpx.AsyncClient, conn: psycopg.AsyncConnection,
                         intents: list[Intent], bar: Any, bars: Any) -> None:
        client = AsyncRetryingClient(http, attempts=12, initial=0.05, max_delay=2.5,
                                     timeout=40)
        result = results[side]
        account = f"demo-{run}-{side[0]}-c{intents[0].client:02d}"
        headers = {"X-Account": account}

        async def send(amount: int, key: str) -> None:
            try:
                response = await client.post(PATHS[side], json={"amount": amount,
                                                                 "currency": "EUR"},
                                             key=key, headers=headers)
                result.answers[response.status_code] += 1
            except httpx.TransportError:
                result.gave_up += 1

        for intent in intents:
            key = str(uuid.uuid4())
            plans[key] = intent.fault
            await conn.execute(  # the intent is on record before its first attempt
                f"INSERT INTO {SCHEMA}.intents VALUES (%s, %s, %s, %s, %s, %s)",
                (run, side, account, key, intent.amount, intent.fault))
            if intent.fault == "double":
                await asyncio.gather(send(intent.amount, key), send(intent.amount, key))
            else:
                await send(intent.amount, key)
            if intent.fault == "reuse":
                await send(intent.amount + 1, key)
            if bars is not None:
                bars.advance(bar)

    async def one_side(side: str, bars: Any) -> None:
        bar = bars.add_task(side, total=sum(map(len, plan))) if bars is not None else None
        transport = FaultTransport(httpx.AsyncHTTPTransport(), plans)
        limits = httpx.Limits(max_connections=4 * clients)
        started = time.monotonic()
        async with httpx.AsyncClient(base_url=base, transport=transport, limits=limits,
                                     timeout=30) as http, \
                await psycopg.AsyncConnection.connect(demo_dsn, autocommit=True) as conn:
            await asyncio.gather(*(one_client(side, http, conn, intents, bar, bars)
                                   for intents in plan))
        results[side].seconds = time.monotonic() - started

    await side_pool.open()
    await processor_pool.open()
    serving = None
    try:
        async with protected.router.lifespan_context(protected):
            serving = asyncio.create_task(server.serve(sockets=[sock]))
            while not server.started:
                if serving.done():
                    serving.result()
                await asyncio.sleep(0.01)
            if progress:
                columns = (TextColumn("{task.description:<12}"), BarColumn(),
                           MofNCompleteColumn(), TimeElapsedColumn())
                with Progress(*columns, console=console, transient=False) as bars:
                    await asyncio.gather(*(one_side(side, bars) for side in SIDES))
            else:
                await asyncio.gather(*(one_side(side, None) for side in SIDES))
    finally:
        if serving is not None:
            server.should_exit = True
            await serving
        sock.close()
        await side_pool.close()
        await processor_pool.close()

    summary: dict[str, Any] = {}
    async with await psycopg.AsyncConnection.connect(demo_dsn, autocommit=True) as conn, \
            conn.cursor(row_factory=dict_row) as cur:
        for side in SIDES:
            await cur.execute(SUMMARY, {"run": run, "side": side})
            row = await cur.fetchone()
            assert row is not None
            stats, result = front.stats[side], results[side]
            summary[side] = {
                "intents": row["intents"],
                "http_attempts": stats.attempts,
                "replays": stats.replays,
                "http_409": stats.statuses[409],
                "http_422": stats.statuses[422],
                "workers_killed": stats.killed,
                "resumed_leases": int(row["resumed"]),
                "charges_executed": row["charges"],
                "ledger_rows": row["ledger_rows"],
                "duplicate_charges": row["charges"] - row["charged"],
                "duplicate_ledger_rows": row["ledger_rows"] - row["booked"],
                "lost_payments": row["intents"] - row["booked"],
                "client_answers": {str(k): v for k, v in sorted(result.answers.items())},
                "client_gave_up": result.gave_up,
                "seconds": round(result.seconds, 2),
            }
    return summary


def _with_search_path(dsn: str) -> str:
    """The DSN with the demo's schema first on the search_path (the example's unqualified
    ``ledger`` lands there, never on a table of the same name in public)."""
    options = conninfo_to_dict(dsn).get("options") or ""
    return make_conninfo(dsn, options=f"{options} -c search_path={SCHEMA},public".strip())


# -- the report -------------------------------------------------------------------------------

ROWS = [
    ("intents", "intents (payments wanted)"),
    ("http_attempts", "HTTP attempts"),
    ("replays", "replays"),
    ("http_409", "409 in progress"),
    ("http_422", "422 key reused"),
    ("workers_killed", "workers killed (502)"),
    ("resumed_leases", "resumed leases"),
    ("charges_executed", "charges executed"),
    ("ledger_rows", "ledger rows"),
    ("duplicate_charges", "duplicate charges"),
    ("duplicate_ledger_rows", "duplicate ledger rows"),
    ("lost_payments", "lost payments"),
]


def failures(summary: dict[str, Any]) -> list[str]:
    """What makes the protected side a failure: any duplicate or lost payment."""
    p = summary["protected"]
    return [name for name in ("duplicate_charges", "duplicate_ledger_rows", "lost_payments")
            if p[name] != 0]


def render(summary: dict[str, Any], console: Console) -> None:
    table = Table(title=f"retry storm, seed {summary['seed']}: {summary['clients']} clients x "
                  f"{summary['payments']} payments")
    table.add_column("")
    table.add_column("protected", justify="right")
    table.add_column("unprotected twin", justify="right")
    for name, label in ROWS:
        p, u = summary["protected"][name], summary["unprotected"][name]
        bad = name in ("duplicate_charges", "duplicate_ledger_rows", "lost_payments")
        table.add_row(label, _cell(p, bad), _cell(u, bad))
    console.print(table)
    faults = ", ".join(f"{k} {v}" for k, v in summary["faults"].items())
    console.print(f"faults: {faults}")
    failed = failures(summary)
    if failed:
        console.print(f"[bold red]FAIL[/]: the protected endpoint shows {', '.join(failed)}")
    else:
        u = summary["unprotected"]
        console.print(
            "[bold green]OK[/]: every payment charged exactly once behind pg_idempotency; "
            f"the unprotected twin charged {u['duplicate_charges']} times too often and lost "
            f"{u['lost_payments']}.")


def _cell(value: int, bad: bool) -> str:
    if not bad:
        return str(value)
    return f"[bold red]{value}[/]" if value else f"[green]{value}[/]"


def run(dsn: str, conn: psycopg.Connection, *, clients: int, payments_each: int, seed: int,
        as_json: bool) -> int:
    """Install the schema if needed, run the storm, print the summary; 1 if the protected side
    shows a duplicate or lost payment."""
    console = Console(stderr=as_json)
    for version in migrate(conn):
        console.print(f"installed migration {version:04d}")
    conn.execute(TABLES)
    plan = schedule(clients, payments_each, seed)
    run_id = uuid.uuid4().hex[:8]
    if not as_json:
        console.print(f"serving examples/payments and its unprotected twin on 127.0.0.1; "
                      f"{clients} clients x {payments_each} payments each, seed {seed}")
    summary = asyncio.run(storm(dsn, plan, run_id, progress=not as_json, console=console))
    summary.update(run=run_id, seed=seed, clients=clients, payments=payments_each,
                   faults=dict(sorted(Counter(i.fault for c in plan for i in c).items())),
                   schedule=[[i.fault for i in c] for c in plan],
                   ok=not failures(summary))
    if as_json:
        sys.stdout.write(json.dumps(summary, indent=2) + "\n")
    else:
        render(summary, console)
    return 0 if summary["ok"] else 1
