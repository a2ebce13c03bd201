"""Outages answer as outages (issue 33): a database that cannot be reached, a lost connection,
a server shutting down or starting up is :class:`pg_idempotency.DatabaseUnavailable` in the
package (sync and async) and 503 with Retry-After in every HTTP adapter, never a 500, never a
stored answer; the retrying client backs off with jitter and gets through once the server is
back.

Its own PostgreSQL server (the test stops and starts it). Under load from retrying clients, the
app's backends are terminated (``pg_terminate_backend``) and the server is stopped (fast
shutdown: 57P01 to the sessions, 57P03 to new ones, then refused connections) and started again,
while each adapter serves real HTTP (uvicorn, Django's and werkzeug's threaded WSGI servers).
Every answer is counted: 0 x 500, every 503 carries Retry-After, every acknowledged intent has
exactly one business row, no intent has two, and every intent eventually succeeds.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import flask
import httpx
import psycopg
import pytest
from django.db import connections
from django.http import HttpRequest, HttpResponse
from django.urls import path as django_path
from helpers import MIGRATION_PSQL_ARGS, MIGRATIONS
from helpers.django_example import django_on
from helpers.http import uvicorn_server, with_pool_lifespan, wsgi_server
from psycopg_pool import AsyncConnectionPool, ConnectionPool
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

import pg_idempotency as idem
import pg_idempotency.django as pg_django
from pg_idempotency import aio, contract
from pg_idempotency import asgi as pg_asgi
from pg_idempotency import flask as pg_flask
from pg_idempotency.client import RetryingClient
from pg_idempotency.errors import DatabaseUnavailable, connection_lost, from_psycopg
from pgharness import WAIT_BOUND, PgServer, flavour_bindir

APP = "outage-app"
LEASE = 1.0
CLIENTS = 6
# per client, at least: each goes on until the server is back after the outage, so that requests
# are in flight when it stops (a fast package got all of them through before it, and the wait
# for 503s then had nobody to answer)
INTENTS = 6
ADAPTERS = ["asgi", "django", "flask", "wsgi"]
LEDGER = "CREATE TABLE ledger (intent text NOT NULL)"


@pytest.fixture(scope="module")
def srv() -> Iterator[PgServer]:
    with PgServer(flavour_bindir("pg18"), name="outage") as server:
        dsn = server.dsn()
        for migration in sorted(MIGRATIONS.glob("*.sql")):
            server.run_psql(dsn, migration, args=MIGRATION_PSQL_ARGS)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(LEDGER)
        yield server


def _fresh(srv: PgServer) -> str:
    """An empty ledger and key table on the running server; its DSN for the app."""
    with psycopg.connect(srv.dsn(), autocommit=True) as conn:
        conn.execute("TRUNCATE ledger")
        conn.execute("DELETE FROM idempotency.keys")
    # connect_timeout only bounds a connection that hangs: a stopped server refuses at once.
    return srv.dsn() + f"?application_name={APP}&connect_timeout={WAIT_BOUND:.0f}"


def _stop(srv: PgServer) -> None:
    """Fast shutdown (SIGINT): sessions get 57P01, new connections 57P03, then refused."""
    assert srv._pg is not None and srv._pg.child_process is not None
    srv._pg.child_process.send_signal(signal.SIGINT)
    srv._pg.child_process.wait(WAIT_BOUND)
    srv._pg.child_process = None


def _terminate_app_backends(srv: PgServer) -> int:
    """Every other client session (the app's: Django's connections carry no
    application_name)."""
    with psycopg.connect(srv.dsn(), autocommit=True) as conn:
        return len(conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                "WHERE backend_type = 'client backend' "
                                "AND pid <> pg_backend_pid()").fetchall())


# -- the package: DatabaseUnavailable ----------------------------------------------------------

def test_translation_of_outage_errors() -> None:
    lookup = psycopg.errors.lookup
    for exc in (lookup("57P01")("terminating connection due to administrator command"),
                lookup("57P02")("crash"), lookup("57P03")("the database system is starting up"),
                lookup("08006")("connection to a worker lost"), lookup("08001")("refused"),
                psycopg.OperationalError("server closed the connection unexpectedly")):
        mapped = from_psycopg(exc)
        assert isinstance(mapped, DatabaseUnavailable), exc
        assert mapped.sqlstate is None and mapped.retry_after > 0 and mapped.pgerror is exc
        assert connection_lost(RuntimeError("wrapped")) is False
        try:
            raise RuntimeError("a framework's wrapper") from exc
        except RuntimeError as wrapper:
            assert connection_lost(wrapper)
    for exc in (lookup("57014")("canceling statement"), lookup("40P01")("deadlock"),
                lookup("53300")("too many connections")):
        assert not isinstance(from_psycopg(exc), DatabaseUnavailable), exc
    assert idem.DatabaseUnavailable is DatabaseUnavailable
    answer = contract.unavailable(contract.Settings(unavailable_retry_after=2.5))
    assert answer.status == 503 and ("Retry-After", "3") in answer.headers
    assert json.loads(answer.body)["status"] == 503


def _business(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT count(*) FROM ledger").fetchone()[0]  # type: ignore[index]


def _key(dsn: str, key: str) -> tuple[str, int | None] | None:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT state::text, response_status FROM idempotency.keys "
                           "WHERE key = %s", (key,)).fetchone()
    return None if row is None else (row[0], row[1])


def test_operation_raises_database_unavailable_and_leaves_nothing_half_done(
        srv: PgServer) -> None:
    dsn = _fresh(srv)
    # lost in the block: the business write rolls back with the never-sent complete
    with psycopg.connect(dsn) as conn, pytest.raises(DatabaseUnavailable) as caught:
        with idem.operation(conn, "acct", "k-sync", {"a": 1}, lease=LEASE) as op:
            conn.execute("INSERT INTO ledger VALUES ('k-sync')")
            assert _terminate_app_backends(srv) >= 1
            op.complete(201, {"ok": True})
    assert isinstance(caught.value.pgerror, psycopg.OperationalError)
    assert _business(dsn) == 0 and _key(dsn, "k-sync") == ("in_progress", None)
    # a connection lost before the block: nothing is sent, nothing claimed
    with psycopg.connect(dsn) as conn:
        _terminate_app_backends(srv)
        with pytest.raises(psycopg.OperationalError):
            conn.execute("SELECT 1")  # the caller's own query: psycopg's error
        with pytest.raises(DatabaseUnavailable), idem.operation(conn, "acct", "k-lost"):
            pass
    assert _key(dsn, "k-lost") is None
    # a claim on a server that is shutting down / gone
    with psycopg.connect(dsn, autocommit=True) as conn:
        _stop(srv)
        try:
            with pytest.raises(DatabaseUnavailable):
                idem.claim(conn, "acct", "k-down", {"a": 1})
        finally:
            srv.restart()
    # the same on an async connection; after the lease a retry resumes and completes
    time.sleep(LEASE)  # the lease of k-sync must have expired: the point of the test

    async def run() -> None:
        conn = await psycopg.AsyncConnection.connect(dsn)
        try:
            with pytest.raises(DatabaseUnavailable):
                async with aio.operation(conn, "acct", "k-async", {"a": 1}, lease=LEASE) as op:
                    await conn.execute("INSERT INTO ledger VALUES ('k-async')")
                    _terminate_app_backends(srv)
                    await op.complete(201, {"ok": True})
        finally:
            await conn.close()
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            async with aio.operation(conn, "acct", "k-sync", {"a": 1}, lease=LEASE) as op:
                assert op.outcome is idem.Outcome.RESUMED
                await conn.execute("INSERT INTO ledger VALUES ('k-sync')")
                await op.complete(201, {"ok": True})

    asyncio.run(run())
    assert _key(dsn, "k-async") == ("in_progress", None)
    assert _key(dsn, "k-sync") == ("completed", 201) and _business(dsn) == 1


# -- the adapters, under load ------------------------------------------------------------------

def _asgi_app(dsn: str) -> Any:
    pool = AsyncConnectionPool(dsn, min_size=2, max_size=10, open=False, timeout=2)

    async def pay(request: Request) -> Response:
        intent = json.loads(await request.body())["intent"]
        op = pg_asgi.get_operation(request)
        assert op is not None
        await op.conn.execute("INSERT INTO ledger VALUES (%s)", (intent,))
        return Response(json.dumps({"intent": intent}), status_code=201,
                        media_type="application/json")

    inner = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    return with_pool_lifespan(pool, pg_asgi.IdempotencyMiddleware(
        inner, pool=pool, scope=lambda r: "acct", routes={"POST /pay": "required"},
        lease=LEASE))


@pg_django.idempotent(scope=lambda r: "acct", lease=LEASE)
def django_pay(request: HttpRequest) -> HttpResponse:
    intent = json.loads(request.body)["intent"]
    with connections["default"].cursor() as cursor:
        cursor.execute("INSERT INTO ledger VALUES (%s)", [intent])
    return HttpResponse(json.dumps({"intent": intent}), status=201,
                        content_type="application/json")


urlpatterns = [django_path("pay", django_pay)]


def _flask_app(pool: ConnectionPool, middleware: bool) -> Any:
    app = flask.Flask(__name__)

    def pay() -> Any:
        intent = flask.request.get_json()["intent"]
        op = pg_flask.get_operation()
        assert op is not None
        op.conn.execute("INSERT INTO ledger VALUES (%s)", (intent,))
        return {"intent": intent}, 201

    if middleware:
        app.add_url_rule("/pay", "pay", pay, methods=["POST"])
        app.wsgi_app = pg_flask.IdempotencyMiddleware(  # type: ignore[method-assign]
            app.wsgi_app, pool=pool, scope=lambda environ: "acct",
            routes={"POST /pay": "required"}, lease=LEASE)
    else:
        idem_ = pg_flask.Idempotency(pool, scope=lambda r: "acct", lease=LEASE)
        app.add_url_rule("/pay", "pay", idem_.idempotent(pay), methods=["POST"])
    return app


@contextmanager
def _serve(adapter: str, dsn: str) -> Iterator[str]:
    if adapter == "asgi":
        with uvicorn_server(_asgi_app(dsn)) as base:
            yield base
    elif adapter == "django":
        with django_on(dsn, __name__) as app, wsgi_server(app, django=True) as base:
            yield base
    else:
        with ConnectionPool(dsn, min_size=2, max_size=10, open=True, timeout=2) as pool:
            with wsgi_server(_flask_app(pool, adapter == "wsgi").wsgi_app) as base:
                yield base


class Tally:
    """Every answer any attempt got, and the intents acknowledged (a final 201)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.statuses: Counter[int] = Counter()
        self.without_retry_after = 0
        self.transport_errors = 0
        self.acknowledged: list[str] = []
        self.progress = threading.Condition(self.lock)

    def answer(self, response: httpx.Response) -> None:
        with self.lock:
            self.statuses[response.status_code] += 1
            if response.status_code == 503:
                if "retry-after" not in response.headers:
                    self.without_retry_after += 1
                assert response.headers["content-type"] == "application/problem+json"
            self.progress.notify_all()

    def wait_for(self, what: str, predicate: Any) -> None:
        with self.progress:
            assert self.progress.wait_for(predicate, WAIT_BOUND), f"waited in vain for {what}"


def _client(base: str, tally: Tally, worker: int, failures: list[str], enough: threading.Event,
            attempted: list[int]) -> None:
    # The bounds only stop a hang (a loaded machine answers slowly, never wrongly): a give-up
    # is a failure of the test, which expects every intent through.
    http = httpx.Client(base_url=base, timeout=WAIT_BOUND,
                        event_hooks={"response": [tally.answer]})
    client = RetryingClient(http, attempts=10_000, initial=0.05, max_delay=1.0,
                            timeout=WAIT_BOUND)
    n = 0
    try:
        while n < INTENTS or not enough.is_set():
            intent = f"w{worker}-{n}"
            n += 1
            attempted[worker] = n
            try:
                response = client.post("/pay", json={"intent": intent}, key=intent)
            except httpx.TransportError as exc:
                with tally.lock:
                    tally.transport_errors += 1
                failures.append(f"{intent}: {exc!r}")
                continue
            if response.status_code == 201 and response.json() == {"intent": intent}:
                with tally.lock:
                    tally.acknowledged.append(intent)
                    tally.progress.notify_all()
            else:
                failures.append(f"{intent}: {response.status_code} {response.text}")
    finally:
        http.close()


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_outage_under_load_answers_503_and_loses_nothing(adapter: str, srv: PgServer) -> None:
    dsn = _fresh(srv)
    tally = Tally()
    failures: list[str] = []
    enough = threading.Event()  # set once the server is back: the clients finish then
    attempted = [0] * CLIENTS
    with _serve(adapter, dsn) as base:
        threads = [threading.Thread(target=_client,
                                    args=(base, tally, i, failures, enough, attempted))
                   for i in range(CLIENTS)]
        for t in threads:
            t.start()
        try:
            # kill the app's backends three times while answers are flowing
            for round_no in range(1, 4):
                tally.wait_for("completions", lambda r=round_no: len(tally.acknowledged)
                               >= r * 3)
                _terminate_app_backends(srv)
            # then stop the server until the adapter has answered 503 a few times
            before = tally.statuses[503]
            _stop(srv)
            try:
                tally.wait_for("503s while the server is down",
                               lambda: tally.statuses[503] >= before + CLIENTS)
            finally:
                srv.restart()
        finally:
            enough.set()
            for t in threads:
                t.join(WAIT_BOUND)
    assert not any(t.is_alive() for t in threads)
    total = sum(attempted)
    assert total >= CLIENTS * INTENTS
    assert tally.statuses[500] == 0, tally.statuses
    assert tally.without_retry_after == 0
    assert tally.transport_errors == 0 and failures == [], failures
    assert set(tally.statuses) <= {201, 409, 503}, tally.statuses
    assert tally.statuses[503] >= CLIENTS
    assert len(tally.acknowledged) == total  # the retrying client got every intent through
    with psycopg.connect(srv.dsn()) as conn:
        rows = dict(conn.execute("SELECT intent, count(*) FROM ledger GROUP BY intent"
                                 ).fetchall())
        completed = conn.execute("SELECT count(*) FROM idempotency.keys WHERE state = "
                                 "'completed'").fetchone()[0]  # type: ignore[index]
    assert all(rows.get(i) == 1 for i in tally.acknowledged), rows  # 0 lost
    assert max(rows.values()) == 1 and len(rows) == total  # 0 duplicated
    assert completed == total
    print(f"{adapter}: answers {dict(tally.statuses)}")
