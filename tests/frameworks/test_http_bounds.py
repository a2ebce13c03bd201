"""Bounds over HTTP (issue 34), the same in every adapter, over real HTTP on real PostgreSQL:

- every client mistake is a 4xx problem+json naming what was wrong: a JSON body nested deeper
  than 128 (400; 128 levels of the body as sent are taken), a scope from the app's callback
  over 255 characters (400, naming the scope), a key outside RFC 8941's sf-string characters
  (400: ``clé``, ``ключ``, raw bytes), nothing claimed for any of them;
- what a quoted header stores is the key ``pg-idempotency keys show`` finds;
- a request body over ``max_request_bytes`` is 413 before any claim (by Content-Length, and
  counted while reading a chunked body); an answer over ``max_response_bytes`` is 507, not
  stored: its write rolled back, its key released, and a retry with the same key runs afresh;
- per-route policy: fields left out of the fingerprint (a client timestamp, a trace id) or
  only some counted, per route.

And the memory of the ASGI middleware per call stays bounded with bodies at and over the limits
(tracemalloc peak), and the retrying client never resends a 4xx.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tracemalloc
import types
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import flask
import psycopg
import pytest
from django.db import connections
from django.http import HttpRequest, HttpResponse
from django.urls import path as django_path
from helpers.bounds_apps import (
    ADAPTERS,
    LEDGER,
    MAX_REQUEST,
    MAX_RESPONSE,
    keys_of,
    ledger,
    post,
    problem,
    serve,
)
from helpers.django_example import django_on
from psycopg_pool import AsyncConnectionPool, ConnectionPool

import pg_idempotency.django as pg_django
from pg_idempotency import asgi as pg_asgi
from pg_idempotency import contract
from pg_idempotency import flask as pg_flask
from pg_idempotency.contract import Route


@pytest.fixture(params=ADAPTERS)
def served(request: pytest.FixtureRequest, db: str) -> Iterator[tuple[str, str, str]]:
    with serve(request.param, db) as base:
        yield request.param, base, db


def test_client_mistakes_are_4xx_and_claim_nothing(served: tuple[str, str, str]) -> None:
    adapter, base, dsn = served
    deep: Any = 1
    for _ in range(200):
        deep = [deep]
    problem(post(base, "/pay", "deep", {"intent": "deep", "x": deep}), 400, "128")
    problem(post(base, "/pay", "long-scope", {"intent": "s"}, account="a" * 300), 400,
            "scope", "255")
    for bad in ("clé".encode(), "ключ".encode(), b"k\xff\xfe", b'"unterminated', b"a b",
                b'"' + b"k" * 256 + b'"', b'""'):
        problem(post(base, "/pay", bad, {"intent": "k"}), 400, "printable ASCII")
    assert keys_of(dsn) == [] and ledger(dsn, "deep") == 0


def test_nesting_counts_the_body_as_sent(served: tuple[str, str, str]) -> None:
    """A body nested exactly 128 deep is taken (the engine's limit for a request), 129 is 400
    naming the limit, nothing claimed for it."""
    adapter, base, dsn = served
    for levels in (128, 129):
        inner: Any = 1
        for _ in range(levels - 1):
            inner = [inner]
        r = post(base, "/pay", f"n{levels}", {"intent": f"n{levels}", "x": inner})
        if levels == 128:
            assert r.status_code == 201, r.text
        else:
            problem(r, 400, "128")
    assert keys_of(dsn) == [("acct", "n128", "completed")]
    assert (ledger(dsn, "n128"), ledger(dsn, "n129")) == (1, 0)


def test_quoted_key_is_what_keys_show_finds(served: tuple[str, str, str]) -> None:
    adapter, base, dsn = served
    first = post(base, "/pay", b'"order \\"7\\" k"', {"intent": "q"})
    assert first.status_code == 201, first.text
    again = post(base, "/pay", b'"order \\"7\\" k"', {"intent": "q"})
    assert again.headers["idempotent-replayed"] == "true"
    assert keys_of(dsn) == [("acct", 'order "7" k', "completed")]
    shown = subprocess.run([os.path.join(os.path.dirname(sys.executable), "pg-idempotency"),
                            "keys", "show", "acct", 'order "7" k', "--json"],
                           env={**os.environ, "DATABASE_URL": dsn}, capture_output=True,
                           text=True, check=True)
    assert json.loads(shown.stdout)["state"] == "completed"
    bare = post(base, "/pay", "bare-token_1.~", {"intent": "b"})
    assert bare.status_code == 201 and ("acct", "bare-token_1.~", "completed") in keys_of(dsn)


def test_request_and_response_limits(served: tuple[str, str, str]) -> None:
    adapter, base, dsn = served
    at_limit = json.dumps({"intent": "at", "pad": "y" * (MAX_REQUEST - 30)}).encode()
    at_limit += b" " * (MAX_REQUEST - len(at_limit))
    assert len(at_limit) == MAX_REQUEST
    assert post(base, "/pay", "at", None, raw=at_limit).status_code == 201
    problem(post(base, "/pay", "over", None, raw=at_limit + b" "), 413, str(MAX_REQUEST))
    if adapter not in ("django", "django-mw"):  # Django's WSGI server reads no chunked body

        def chunks() -> Iterator[bytes]:
            yield at_limit
            yield b" " * 10

        problem(post(base, "/pay", "chunked", None, raw=chunks()), 413)
    # an answer over the limit: 507, not stored, the write rolled back, the key released
    too_big = post(base, "/pay", "big", {"intent": "big", "size": MAX_RESPONSE + 1})
    problem(too_big, 507, str(MAX_RESPONSE))
    assert ledger(dsn, "big") == 0
    assert ("acct", "big", "released") in keys_of(dsn)
    small = post(base, "/pay", "big", {"intent": "big", "size": 10})
    assert small.status_code == 201 and ledger(dsn, "big") == 1
    assert {k for _, k, _ in keys_of(dsn)} == {"at", "big"}  # nothing claimed for 413s


def test_per_route_fingerprint(served: tuple[str, str, str]) -> None:
    adapter, base, dsn = served
    body = {"intent": "p", "amount": 50, "sent_at": "12:00:00", "trace": {"id": "t1", "n": 1}}
    assert post(base, "/pay", "p1", body).status_code == 201
    # another timestamp and trace id: the same request, a replay
    same = post(base, "/pay", "p1", {**body, "sent_at": "12:00:05",
                                     "trace": {"id": "t2", "n": 1}})
    assert same.status_code == 201 and same.headers["idempotent-replayed"] == "true"
    # another trace.n (not excluded) or amount: another request
    problem(post(base, "/pay", "p1", {**body, "trace": {"id": "t1", "n": 2}}), 422)
    problem(post(base, "/pay", "p1", {**body, "amount": 51}), 422)
    # /only counts the amount alone
    assert post(base, "/only", "o1", {"intent": "o", "amount": 5, "note": "a"}).status_code == 201
    replay = post(base, "/only", "o1", {"intent": "o", "amount": 5, "note": "b"})
    assert replay.headers["idempotent-replayed"] == "true"
    problem(post(base, "/only", "o1", {"intent": "o", "amount": 6}), 422)
    assert ledger(dsn, "p") == 1 and ledger(dsn, "o") == 1


def test_per_route_lease_is_the_stored_lease(served: tuple[str, str, str]) -> None:
    """/pay has ``lease=7`` (Route, the Django decorator's and settings' ``lease``, Flask's
    idempotent(lease=)); /only the adapter's default (30 s): the claim the adapter made holds
    that lease (lease_expires_at - created_at of the stored key, read as the owner)."""
    adapter, base, dsn = served
    with psycopg.connect(dsn, autocommit=True) as conn:
        # The lease as the handler's transaction sees its key, in progress (complete clears
        # lease_expires_at): recorded by a trigger on the handler's ledger insert.
        conn.execute("""
            CREATE TABLE lease_seen (key text, seconds float8);
            CREATE FUNCTION see_lease() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                INSERT INTO lease_seen
                SELECT k.key, extract(epoch FROM k.lease_expires_at - k.created_at)
                FROM idempotency.keys AS k
                WHERE k.key = NEW.intent AND k.state = 'in_progress';
                RETURN NEW;
            END $$;
            CREATE TRIGGER see_lease AFTER INSERT ON ledger FOR EACH ROW
                EXECUTE FUNCTION see_lease()""")
    assert post(base, "/pay", "lease-7", {"intent": "lease-7"}).status_code == 201
    assert post(base, "/only", "lease-default",
                {"intent": "lease-default", "amount": 1}).status_code == 201
    with psycopg.connect(dsn) as conn:
        leases = dict(conn.execute("SELECT key, seconds FROM lease_seen").fetchall())
    assert set(leases) == {"lease-7", "lease-default"}, leases
    assert abs(leases["lease-7"] - 7) < 0.5, (adapter, leases)
    assert abs(leases["lease-default"] - contract.Settings().lease_seconds) < 0.5, leases


def test_route_contract() -> None:
    settings = contract.Settings(lease=30)
    routes = contract.Routes({"POST /a": Route("optional", lease=timedelta(seconds=90)),
                              "POST /b": {"fingerprint_fields": ["x.y"]}, "POST /c": "required"})
    assert routes.route("POST", "/a").lease_of(settings) == timedelta(seconds=90)
    assert routes.route("POST", "/c").lease_of(settings) == 30
    assert routes.policy("POST", "/b") is contract.Policy.REQUIRED
    assert routes.policy("POST", "/z") is contract.Policy.IGNORED
    b = routes.route("POST", "/b")
    assert b.body_for_fingerprint({"x": {"y": 1, "z": 2}, "w": 3}) == {"x": {"y": 1}}
    assert b.body_for_fingerprint([1, 2]) == [1, 2]  # not an object: counts whole
    with pytest.raises(ValueError, match="list of field names"):
        Route(fingerprint_fields="amount")
    with pytest.raises(ValueError, match="policy"):
        Route("sometimes")
    with pytest.raises(ValueError, match="max_request_bytes"):
        contract.Settings(max_request_bytes=0)


# -- memory per call: the ASGI middleware keeps nothing past the limits ----------------------

def test_asgi_memory_is_bounded_at_and_over_the_limits(db: str) -> None:
    limit = 1048576  # the defaults
    chunk = 65536

    async def app(scope: Any, receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        size = json.loads(body)["answer"]
        await send({"type": "http.response.start", "status": 201,
                    "headers": [(b"content-type", b"application/octet-stream")]})
        sent = 0
        while sent < size:  # streamed in chunks: 16 MB over the limit must not be kept
            part = min(chunk, size - sent)
            sent += part
            await send({"type": "http.response.body", "body": b"z" * part,
                        "more_body": sent < size})

    async def call(mw: Any, key: str, request_size: int, answer: int) -> tuple[int, int]:
        head = json.dumps({"answer": answer}).encode()
        payload = head + b" " * max(0, request_size - len(head))
        parts = [payload[i:i + chunk] for i in range(0, len(payload), chunk)]
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            part = parts.pop(0) if parts else b""
            return {"type": "http.request", "body": part, "more_body": bool(parts)}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/m", "query_string": b"",
                 "headers": [(b"idempotency-key", key.encode()),
                             (b"content-type", b"application/json")]}
        tracemalloc.start()
        tracemalloc.reset_peak()
        await mw(scope, receive, send)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return sent[0]["status"], peak

    async def run() -> dict[str, tuple[int, int]]:
        async with AsyncConnectionPool(db, min_size=1, max_size=3) as pool:
            mw = pg_asgi.IdempotencyMiddleware(app, pool=pool, scope=lambda r: "acct",
                                               routes={"POST /m": "required"})
            return {
                "request at limit": await call(mw, "r1", limit, 10),
                "request over (chunked, 16 MB)": await call(mw, "r2", 16 * limit, 10),
                "answer at limit": await call(mw, "a1", 100, limit),
                "answer over (16 MB)": await call(mw, "a2", 100, 16 * limit),
            }

    results = asyncio.run(run())
    print({k: (s, f"{p / 1048576:.1f} MB") for k, (s, p) in results.items()})
    assert [s for s, _ in results.values()] == [201, 413, 201, 507]
    # traced from the call on (the test's own payload is built before): the middleware's
    # buffers, the claim and the complete; 16 MB past either limit adds nothing
    assert results["answer over (16 MB)"][1] < 4 * limit, results
    assert results["request over (chunked, 16 MB)"][1] < 2 * limit, results
    assert results["answer at limit"][1] < 8 * limit, results  # ~6.5 MB measured: copies
    assert results["request at limit"][1] < 6 * limit, results
    assert ledger_keys(db) == {"r1": "completed", "a1": "completed", "a2": "released"}


def ledger_keys(dsn: str) -> dict[str, str]:
    with psycopg.connect(dsn) as conn:
        return dict(conn.execute("SELECT key, state::text FROM idempotency.keys").fetchall())


# -- memory per call: the Flask and Django adapters, in process -------------------------------

MIB = 1048576
CHUNK = 65536


class Source:
    """A request body of ``size`` bytes made on demand (``head``, then spaces), counting the
    bytes the adapter reads: what a client streams, never held whole by the test."""

    def __init__(self, head: bytes, size: int) -> None:
        self.head, self.size, self.pos = head, max(size, len(head)), 0
        # Up to a few MB the body is made before the call is traced: a read of it whole is the
        # one bytes object the adapter gets (a slice of all of it is no copy), as from a socket.
        self.data = head + b" " * (self.size - len(head)) if self.size <= 4 * MIB else None

    def read(self, n: int | None = -1) -> bytes:
        left = self.size - self.pos
        n = left if n is None or n < 0 else min(n, left)
        start, self.pos = self.pos, self.pos + n
        if self.data is not None:
            return self.data[start:start + n]
        part = self.head[start:start + n]
        return part + b" " * (n - len(part)) if part else b" " * n

    def readline(self, limit: int = -1) -> bytes:
        return self.read(65536 if limit is None or limit < 0 else limit)


def _memory_environ(key: str, source: Source, chunked: bool) -> dict[str, Any]:
    environ: dict[str, Any] = {
        "REQUEST_METHOD": "POST", "PATH_INFO": "/m", "QUERY_STRING": "", "SCRIPT_NAME": "",
        "SERVER_NAME": "127.0.0.1", "SERVER_PORT": "80", "SERVER_PROTOCOL": "HTTP/1.1",
        "HTTP_HOST": "127.0.0.1", "CONTENT_TYPE": "application/json",
        "HTTP_IDEMPOTENCY_KEY": key, "HTTP_X_ACCOUNT": "acct",
        "wsgi.input": source, "wsgi.errors": sys.stderr, "wsgi.version": (1, 0),
        "wsgi.url_scheme": "http", "wsgi.multithread": True, "wsgi.multiprocess": False,
        "wsgi.run_once": False}
    if chunked:  # what a server that decodes Transfer-Encoding: chunked passes on
        environ["HTTP_TRANSFER_ENCODING"] = "chunked"
        environ["wsgi.input_terminated"] = True
    else:
        environ["CONTENT_LENGTH"] = str(source.size)
    return environ


def _call_wsgi(app: Any, key: str, request_size: int, answer: int, chunked: bool = False
               ) -> tuple[int, int, int]:
    """One request through ``app`` in this process: its status, the tracemalloc peak of the
    call (the answer consumed as a server would) and the request bytes read."""
    source = Source(json.dumps({"intent": key, "answer": answer}).encode(), request_size)
    environ = _memory_environ(key, source, chunked)
    started: list[str] = []

    def start_response(status: str, headers: Any, exc_info: Any = None) -> Any:
        started.append(status)
        return lambda data: None

    tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        result = app(environ, start_response)
        for _ in result:
            pass
        close = getattr(result, "close", None)
        if close is not None:
            close()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return int(started[0].split()[0]), peak, source.pos


def _answer_size(body: bytes) -> tuple[str, int]:
    data = json.loads(body)
    return data["intent"], int(data["answer"])


def _flask_memory_app(pool: ConnectionPool, middleware: bool) -> Any:
    app = flask.Flask(__name__)

    def streamed() -> Any:  # behind the WSGI middleware: the answer streamed in chunks
        intent, size = _answer_size(flask.request.get_data())
        op = pg_flask.get_operation()
        assert op is not None
        op.conn.execute("INSERT INTO ledger VALUES (%s)", (intent,))

        def chunks() -> Iterator[bytes]:
            for sent in range(0, size, CHUNK):
                yield b"z" * min(CHUNK, size - sent)

        return flask.Response(chunks(), status=201, content_type="application/octet-stream")

    def whole() -> Any:  # the decorator stores a whole response (a streamed one is refused)
        intent, size = _answer_size(flask.request.get_data())
        op = pg_flask.get_operation()
        assert op is not None
        op.conn.execute("INSERT INTO ledger VALUES (%s)", (intent,))
        return flask.Response(b"z" * size, status=201, content_type="application/octet-stream")

    if middleware:
        app.add_url_rule("/m", "m", streamed, methods=["POST"])
        app.wsgi_app = pg_flask.IdempotencyMiddleware(  # type: ignore[method-assign]
            app.wsgi_app, pool=pool, scope=lambda environ: "acct", routes={"POST /m": "required"})
        return app.wsgi_app
    idem = pg_flask.Idempotency(pool, scope=lambda r: "acct")
    app.add_url_rule("/m", "m", idem.idempotent(whole), methods=["POST"])
    return app.wsgi_app


def _django_memory_view(request: HttpRequest) -> HttpResponse:
    intent, size = _answer_size(request.body)
    with connections["default"].cursor() as cursor:
        cursor.execute("INSERT INTO ledger VALUES (%s)", [intent])
    return HttpResponse(b"z" * size, status=201, content_type="application/octet-stream")


_MEMORY_URLS = types.ModuleType(f"{__name__}_memory")
_MEMORY_URLS.urlpatterns = [  # type: ignore[attr-defined]
    django_path("m", pg_django.idempotent(scope=lambda r: "acct")(_django_memory_view))]
sys.modules[_MEMORY_URLS.__name__] = _MEMORY_URLS

#: The cases of the WSGI adapters: (name, request size, answer size, chunked). Django's are
#: the same but the chunked one: Django reads a body by its Content-Length only (a chunked
#: body reaches a Django view empty, whatever the server), so there is nothing to bound.
MEMORY_CASES = [("request at limit", MIB, 10, False),
                ("request over (Content-Length, 16 MB)", 16 * MIB, 10, False),
                ("request over (chunked, 16 MB)", 16 * MIB, 10, True),
                ("answer at limit", 100, MIB, False),
                ("answer over (16 MB)", 100, 16 * MIB, False)]


@pytest.mark.parametrize("adapter", ["flask", "wsgi", "django"])
def test_wsgi_memory_is_bounded_at_and_over_the_limits(db: str, adapter: str) -> None:
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute(LEDGER)
    cases = [c for c in MEMORY_CASES if not (adapter == "django" and c[3])]
    results: dict[str, tuple[int, int, int]] = {}
    if adapter == "django":
        with django_on(db, _MEMORY_URLS.__name__) as app:
            for i, (name, request_size, answer, chunked) in enumerate(cases):
                results[name] = _call_wsgi(app, f"k{i}", request_size, answer, chunked)
    else:
        with ConnectionPool(db, min_size=1, max_size=3, open=True) as pool:
            app = _flask_memory_app(pool, middleware=adapter == "wsgi")
            for i, (name, request_size, answer, chunked) in enumerate(cases):
                results[name] = _call_wsgi(app, f"k{i}", request_size, answer, chunked)
    print(adapter, {k: (s, f"{p / MIB:.1f} MB peak", f"{r} B read")
                    for k, (s, p, r) in results.items()})
    status = {k: s for k, (s, _, _) in results.items()}
    peak = {k: p for k, (_, p, _) in results.items()}
    read = {k: r for k, (_, _, r) in results.items()}
    assert status["request at limit"] == 201 and read["request at limit"] == MIB
    assert status["request over (Content-Length, 16 MB)"] == 413
    assert read["request over (Content-Length, 16 MB)"] == 0  # refused by its Content-Length
    assert peak["request over (Content-Length, 16 MB)"] < MIB, peak
    if adapter != "django":
        assert status["request over (chunked, 16 MB)"] == 413
        assert read["request over (chunked, 16 MB)"] <= MIB + 1, read  # limit + 1 at most
        assert peak["request over (chunked, 16 MB)"] < 3 * MIB, peak
    assert status["answer at limit"] == 201 and status["answer over (16 MB)"] == 507
    # the body read, the framework's cached copy of it (Flask's get_data) and the fingerprint's
    # parse: 1.0-3.0 MB measured
    assert peak["request at limit"] < 4 * MIB, peak
    # the answer, its stored copy and complete's statement (the body as a bytea literal, bound
    # by psycopg's ClientCursor: twice its size in hex): ~5.5 MB measured for 1 MiB
    assert peak["answer at limit"] < 7 * MIB, peak
    if adapter == "wsgi":  # a streamed answer: nothing is kept past the limit
        assert peak["answer over (16 MB)"] < 3 * MIB, peak
    else:
        # Flask's decorator and Django store a whole response object, which the view made
        # before the adapter sees it (16 MB here): the adapter adds no copy of it.
        assert peak["answer over (16 MB)"] < 16 * MIB + 2 * MIB, peak
    assert ledger_keys(db) == {f"k{i}": ("completed" if "at limit" in name else "released")
                               for i, (name, *_rest) in enumerate(cases)
                               if "at limit" in name or "answer over" in name}
