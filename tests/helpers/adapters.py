"""One HTTP app behind every adapter (asgi, django, flask, wsgi), served over real HTTP on a
database: what tests/frameworks/test_http_adapters.py runs its table of cases against, and
tests/frameworks/test_telemetry.py its spans."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import asyncpg
import flask
import httpx
import psycopg
from django.db import connections
from django.http import HttpRequest, HttpResponse
from django.urls import path as django_path
from psycopg_pool import AsyncConnectionPool, ConnectionPool
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

import pg_idempotency.django as pg_django
from helpers.django_example import django_on
from helpers.http import uvicorn_server, with_pool_lifespan, wsgi_server
from pg_idempotency import asgi as pg_asgi
from pg_idempotency import flask as pg_flask
from pgharness import WAIT_BOUND, wait_until

LEDGER = "CREATE TABLE IF NOT EXISTS ledger (intent text NOT NULL, note text)"

LEASE = 1.0

ADAPTERS = ["asgi", "asgi-asyncpg", "django", "flask", "wsgi"]


@dataclass
class Plan:
    """What the handler answers (or raises) for a request body."""

    intent: str
    mode: str

    @classmethod
    def of(cls, body: bytes) -> Plan:
        data = json.loads(body)
        return cls(data["intent"], data.get("mode", "ok"))

    def before_write(self) -> float:
        if self.mode == "raise_before":
            raise RuntimeError("failed before the write")
        return 0.0

    def after_write(self) -> tuple[int, bytes, dict[str, str]]:
        """The answer; raises for raise_after."""
        if self.mode == "raise_after":
            raise RuntimeError("failed after the write")
        if self.mode == "fail500":
            return 500, b'{"error":"down"}', {"Content-Type": "application/json"}
        # key order not sorted, no spaces: the replay must be these very bytes
        body = b'{"zeta":1,"a":2,"intent":"%s"}' % self.intent.encode()
        return 201, body, {"Content-Type": "application/json", "Location": f"/pay/{self.intent}",
                           "X-Request-Id": uuid.uuid4().hex}


# Gates that hold a request in its handler (after its write, before its answer) until the test
# opens them; named by the request's X-Gate header (not its body: the body is fingerprinted).
GATES: dict[str, threading.Event] = {}

GATES_LOCK = threading.Lock()


def gate(name: str) -> threading.Event:
    with GATES_LOCK:
        return GATES.setdefault(name, threading.Event())


def pass_gate(name: str | None) -> None:
    if name is not None and not gate(name).wait(WAIT_BOUND):
        raise TimeoutError(f"gate {name} was not opened in {WAIT_BOUND} s")


def sync_handler(body: bytes, write: Callable[[str], None], gate_name: str | None
                 ) -> tuple[int, bytes, dict[str, str]]:
    plan = Plan.of(body)
    if plan.mode == "bare500":
        return 500, b"down", {"Content-Type": "text/plain"}
    plan.before_write()
    write(plan.intent)
    answer = plan.after_write()
    pass_gate(gate_name)
    return answer


def asgi_app(dsn: str, driver: str = "psycopg") -> Any:
    """The Starlette app behind the middleware, over a psycopg pool or an asyncpg one."""
    pool: Any
    made: dict[str, Any] = {}
    if driver == "asyncpg":
        # made by the lifespan, in the server's event loop; the middleware takes it from there
        insert = "INSERT INTO ledger (intent) VALUES ($1)"
    else:
        pool = AsyncConnectionPool(dsn, min_size=1, max_size=12, open=False)
        insert = "INSERT INTO ledger (intent) VALUES (%s)"

    async def write(conn: Any, intent: str) -> None:
        if driver == "asyncpg":
            await conn.execute(insert, intent)
        else:
            await conn.execute(insert, (intent,))

    async def pay(request: Request) -> Response:
        plan = Plan.of(await request.body())
        if plan.mode == "bare500":  # never asks for its operation
            return Response(b"down", status_code=500, media_type="text/plain")
        op = pg_asgi.get_operation(request)
        plan.before_write()
        if op is not None:
            await write(op.conn, plan.intent)
        elif driver == "asyncpg":
            async with made["pool"].acquire() as conn:
                await write(conn, plan.intent)
        else:
            async with pool.connection() as conn:
                await write(conn, plan.intent)
        status, content, headers = plan.after_write()
        if (name := request.headers.get("x-gate")) is not None:
            await asyncio.to_thread(pass_gate, name)
        return Response(content, status_code=status, headers=headers)

    inner = Starlette(routes=[Route(p, pay, methods=["POST"])
                              for p in ("/pay", "/pay-store", "/free")])
    options = {"pool": (lambda: made["pool"]) if driver == "asyncpg" else pool,
               "scope": lambda r: "acct", "lease": LEASE}
    plain = pg_asgi.IdempotencyMiddleware(inner, routes={"POST /pay": "required"}, **options)
    store = pg_asgi.IdempotencyMiddleware(inner, routes={"POST /pay-store": "required"},
                                          store_server_errors=True, **options)

    async def handle(scope: Any, receive: Any, send: Any) -> None:
        crash = (b"x-crash", b"after-commit") in scope.get("headers", [])
        chosen = store if scope["path"] == "/pay-store" else plain
        if not crash:
            await chosen(scope, receive, send)
            return

        async def lose(message: Any) -> None:
            pass  # the worker dies after its commit: the answer never leaves

        await chosen(scope, receive, lose)
        await send({"type": "http.response.start", "status": 502, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    if driver == "asyncpg":
        return asyncpg_lifespan(dsn, made, handle)
    return with_pool_lifespan(pool, handle)


def asyncpg_lifespan(dsn: str, made: dict[str, Any], app: Any) -> Any:
    """``app`` behind a lifespan that makes an asyncpg pool (``made["pool"]``) at startup, in
    the server's event loop, and closes it at shutdown."""

    async def wrapped(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await receive()
            made["pool"] = await asyncpg.create_pool(dsn, min_size=1, max_size=12)
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await made["pool"].close()
            await send({"type": "lifespan.shutdown.complete"})
            return
        await app(scope, receive, send)

    return wrapped


def _django_view(store: bool) -> Any:
    @pg_django.idempotent(scope=lambda r: "acct", lease=LEASE, wait=0,
                          store_server_errors=store)
    def pay(request: HttpRequest) -> HttpResponse:
        return _django_answer(request)

    return pay


def _django_answer(request: HttpRequest) -> HttpResponse:
    def write(intent: str) -> None:
        with connections["default"].cursor() as cursor:
            cursor.execute("INSERT INTO ledger (intent) VALUES (%s)", [intent])

    status, content, headers = sync_handler(request.body, write, request.headers.get("X-Gate"))
    response = HttpResponse(content, status=status, content_type=headers.pop("Content-Type"))
    for name, value in headers.items():
        response[name] = value
    return response

urlpatterns = [  # ROOT_URLCONF of the django app below
    django_path("pay", _django_view(False)),
    django_path("pay-store", _django_view(True)),
    django_path("free", _django_answer),
]


def flask_app(pool: ConnectionPool, *, middleware: bool) -> flask.Flask:
    app = flask.Flask(__name__)

    def answer() -> flask.Response:
        def write(intent: str) -> None:
            op = pg_flask.get_operation()
            if op is not None:
                op.conn.execute("INSERT INTO ledger (intent) VALUES (%s)", (intent,))
            else:
                with pool.connection() as conn:
                    conn.execute("INSERT INTO ledger (intent) VALUES (%s)", (intent,))

        status, content, headers = sync_handler(flask.request.get_data(), write,
                                                flask.request.headers.get("X-Gate"))
        return flask.Response(content, status=status, headers=headers)

    if middleware:
        for rule in ("/pay", "/pay-store", "/free"):
            app.add_url_rule(rule, rule, answer, methods=["POST"])
        options = {"pool": pool, "scope": lambda environ: "acct", "lease": LEASE}
        plain = pg_flask.IdempotencyMiddleware(app.wsgi_app, routes={"POST /pay": "required"},
                                               **options)
        store = pg_flask.IdempotencyMiddleware(app.wsgi_app,
                                               routes={"POST /pay-store": "required"},
                                               store_server_errors=True, **options)
        app.wsgi_app = lambda environ, start: (  # type: ignore[method-assign]
            store if environ["PATH_INFO"] == "/pay-store" else plain)(environ, start)
        return app
    plain_idem = pg_flask.Idempotency(pool, scope=lambda r: "acct", lease=LEASE)
    store_idem = pg_flask.Idempotency(pool, scope=lambda r: "acct", lease=LEASE,
                                      store_server_errors=True)
    app.add_url_rule("/pay", "pay", plain_idem.idempotent(answer), methods=["POST"])
    app.add_url_rule("/pay-store", "pay-store", store_idem.idempotent(answer), methods=["POST"])
    app.add_url_rule("/free", "free", answer, methods=["POST"])
    return app


def crashing(wsgi: Any) -> Any:
    """WSGI: with ``X-Crash: after-commit`` the inner app runs to its end (commit included),
    then its answer is lost: 502."""

    def app(environ: dict[str, Any], start_response: Any) -> Any:
        if environ.get("HTTP_X_CRASH") != "after-commit":
            return wsgi(environ, start_response)
        chunks = wsgi(environ, lambda *args: (lambda data: None))
        list(chunks)
        getattr(chunks, "close", lambda: None)()
        start_response("502 Bad Gateway", [("Content-Length", "0")])
        return [b""]

    return app


@contextmanager
def serve(adapter: str, dsn: str) -> Iterator[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(LEDGER)
    if adapter.startswith("asgi"):
        driver = "asyncpg" if adapter == "asgi-asyncpg" else "psycopg"
        with uvicorn_server(asgi_app(dsn, driver)) as base:
            yield base
    elif adapter == "django":
        with django_on(dsn, __name__) as app, wsgi_server(crashing(app), django=True) as base:
            yield base
    else:
        with ConnectionPool(dsn, min_size=1, max_size=12, open=True) as pool:
            app = flask_app(pool, middleware=adapter == "wsgi")
            with wsgi_server(crashing(app.wsgi_app)) as base:
                yield base


def pay(base: str, key: str | None, intent: str, mode: str = "ok", path: str = "/pay",
        crash: bool = False, query: str = "", gate: str | None = None) -> httpx.Response:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Idempotency-Key"] = key
    if gate is not None:
        headers["X-Gate"] = gate
    if crash:
        headers["X-Crash"] = "after-commit"
    return httpx.post(f"{base}{path}{query}", timeout=WAIT_BOUND, headers=headers,
                      content=json.dumps({"intent": intent, "mode": mode}))


def ledger(dsn: str, intent: str) -> int:
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT count(*) FROM ledger WHERE intent = %s",
                            (intent,)).fetchone()[0]  # type: ignore[index]


def key_state(dsn: str, key: str) -> str | None:
    """The state of the key's one row, None when it was never claimed. release() keeps the
    row, in state released (no lease, no response), for the next claim (engine 0.9.0)."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT state, lease_expires_at, response_status"
                            " FROM idempotency.keys WHERE key = %s", (key,)).fetchall()
    assert len(rows) <= 1, rows
    if not rows:
        return None
    state, lease, status = rows[0]
    if state == "released":
        assert (lease, status) == (None, None), rows
    return str(state)


def until_claimed(dsn: str, key: str) -> None:
    wait_until(lambda: key_state(dsn, key) == "in_progress", f"{key} to be claimed")


def lease_of(dsn: str, key: str) -> tuple[int, bool]:
    """The key's lease token, and whether its lease has run out (by the server's clock, the
    one claim uses to decide a takeover)."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT lease_token, lease_expires_at < clock_timestamp()"
                           " FROM idempotency.keys WHERE key = %s", (key,)).fetchone()
    assert row is not None, key
    return row[0], row[1]


def hold_lease(dsn: str, key: str) -> None:
    """Extend the lease of the attempt that holds ``key`` (scope acct) to 10 minutes, as its
    own heartbeat would: with the apps' 1 s lease, a loaded machine could otherwise let it run
    out before the test's next request, which would take the key over instead of waiting."""
    token, _ = lease_of(dsn, key)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT idempotency.heartbeat('acct', %s, %s, '10 minutes')", (key, token))


def race_takeover(base: str, dsn: str, key: str, intent: str
                  ) -> tuple[httpx.Response, httpx.Response]:
    """A first attempt is held in its handler past its lease; a retry takes the key over and is
    held too; then the first is let go (its complete() must be fenced off, its write rolled
    back), then the taker. Returns (taker's answer, the stale attempt's answer). Each step
    waits for its event (claimed, lease run out, taken over), never for a fixed time."""
    stale_gate, taker_gate = uuid.uuid4().hex, uuid.uuid4().hex
    with ThreadPoolExecutor(2) as pool:
        try:
            stale = pool.submit(pay, base, key, intent, gate=stale_gate)
            until_claimed(dsn, key)
            token, _ = lease_of(dsn, key)
            wait_until(lambda: lease_of(dsn, key)[1], f"{key}'s lease to run out")
            taker = pool.submit(pay, base, key, intent, gate=taker_gate)
            wait_until(lambda: lease_of(dsn, key)[0] != token, f"{key} to be taken over")
            gate(stale_gate).set()
            late = stale.result(WAIT_BOUND)
            gate(taker_gate).set()
            return taker.result(WAIT_BOUND), late
        finally:  # a failed step must not leave a request held (the pool waits for it)
            gate(stale_gate).set()
            gate(taker_gate).set()


def fresh(r: httpx.Response, status: int = 201) -> None:
    assert r.status_code == status, r.text
    assert "idempotent-replayed" not in r.headers


def replayed(r: httpx.Response, of: httpx.Response) -> None:
    assert (r.status_code, r.content) == (of.status_code, of.content)
    assert r.headers["idempotent-replayed"] == "true"
    assert r.headers["content-type"] == of.headers["content-type"]
    assert r.headers.get("location") == of.headers.get("location")


def problem(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/problem+json"
    body: dict[str, Any] = r.json()
    assert body["status"] == status
    return body
