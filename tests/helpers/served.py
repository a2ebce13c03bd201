"""Every adapter behind the HTTP servers a user would run them under, and a raw-socket client:
what tests/frameworks/test_http_servers.py runs its cases against.

- WSGI (the Flask decorator, the WSGI middleware, the Django decorator and middleware), one app
  routing by the path's first segment (``/flask/pay``, ``/wsgi/pay``, ``/django/pay``,
  ``/django-mw/pay``), served by gunicorn (sync and gthread workers, in a process of its own:
  ``helpers.served:wsgi_app()``, the database in ``PGIDEM_TEST_DSN``), waitress and werkzeug's
  server (what ``flask run`` runs), in a thread;
- ASGI (the middleware, ``/asgi/pay``), and Django's decorator and middleware through Django's
  ASGI handler, served by uvicorn, in a thread.

Every handler first writes a row to ``calls`` on a connection of its own (so it stays whatever
happens to the request's transaction: the proof that the handler ran), then its ledger row on
the request's transaction, and answers 201.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

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
from starlette.routing import Route as StarletteRoute

import pg_idempotency.django as pg_django
from helpers import ROOT
from helpers.django_example import use_database
from helpers.http import uvicorn_server, with_pool_lifespan, wsgi_server
from pg_idempotency import asgi as pg_asgi
from pg_idempotency import flask as pg_flask
from pgharness import WAIT_BOUND, wait_until

WSGI_ADAPTERS = ["flask", "wsgi", "django", "django-mw"]
WSGI_SERVERS = ["gunicorn-sync", "gunicorn-gthread", "waitress", "werkzeug"]
#: Each adapter with the servers it runs under.
MATRIX = [(server, adapter) for server in WSGI_SERVERS for adapter in WSGI_ADAPTERS] + [
    ("uvicorn", "asgi"), ("uvicorn", "django"), ("uvicorn", "django-mw")]
TABLES = ("CREATE TABLE IF NOT EXISTS ledger (intent text NOT NULL);"
          "CREATE TABLE IF NOT EXISTS calls (adapter text NOT NULL, size int NOT NULL)")
#: The limit of every adapter here (the default: 1 MiB).
MAX_REQUEST = 1048576


def _called(dsn: str, adapter: str, body: bytes) -> str:
    """The handler's first step: its ``calls`` row, committed at once; then the intent."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO calls VALUES (%s, %s)", (adapter, len(body)))
    return str(json.loads(body)["intent"])


def _answer(intent: str) -> bytes:
    return json.dumps({"intent": intent}).encode()


# -- WSGI --------------------------------------------------------------------------------------

def _flask(dsn: str, pool: ConnectionPool, middleware: bool) -> Any:
    app = flask.Flask(__name__)
    adapter = "wsgi" if middleware else "flask"

    def pay() -> Any:
        intent = _called(dsn, adapter, flask.request.get_data())
        op = pg_flask.get_operation()
        assert op is not None
        op.conn.execute("INSERT INTO ledger VALUES (%s)", (intent,))
        return flask.Response(_answer(intent), status=201, content_type="application/json")

    if middleware:
        app.add_url_rule("/wsgi/pay", "pay", pay, methods=["POST"])
        return pg_flask.IdempotencyMiddleware(
            app.wsgi_app, pool=pool, scope=lambda environ: "acct",
            routes={"POST /wsgi/pay": "required"})
    idem = pg_flask.Idempotency(pool, scope=lambda r: "acct")
    app.add_url_rule("/flask/pay", "pay", idem.idempotent(pay), methods=["POST"])
    return app.wsgi_app


def _django_view(request: HttpRequest) -> HttpResponse:
    adapter = "django" if request.path.startswith("/django/") else "django-mw"
    intent = _called(_django_dsn[0], adapter, request.body)
    with connections["default"].cursor() as cursor:
        cursor.execute("INSERT INTO ledger VALUES (%s)", [intent])
    return HttpResponse(_answer(intent), status=201, content_type="application/json")


_django_dsn = [""]
_URLS = types.ModuleType(f"{__name__}_urls")
_URLS.urlpatterns = [  # type: ignore[attr-defined]
    django_path("django/pay", pg_django.idempotent(scope=lambda r: "acct")(_django_view)),
    django_path("django-mw/pay", _django_view),
]
sys.modules[_URLS.__name__] = _URLS


def _django(dsn: str, stack: ExitStack) -> None:
    """Django's settings for the two Django routes, on ``dsn``, until ``stack`` closes."""
    from django.test import override_settings

    _django_dsn[0] = dsn
    use_database(dsn, False)
    stack.callback(connections.close_all)
    stack.enter_context(override_settings(
        ROOT_URLCONF=_URLS.__name__, DEBUG=False,
        MIDDLEWARE=["pg_idempotency.django.IdempotencyMiddleware"],
        PG_IDEMPOTENCY={"SCOPE": lambda r: "acct",
                        "ROUTES": {"POST /django-mw/pay": "required"}}))


def wsgi_app(dsn: str | None = None, stack: ExitStack | None = None) -> Any:
    """The four WSGI adapters in one app, routed by the path's first segment. Without
    arguments (gunicorn's ``helpers.served:wsgi_app()``), on ``PGIDEM_TEST_DSN``, for the
    life of the process."""
    dsn = dsn or os.environ["PGIDEM_TEST_DSN"]
    stack = stack if stack is not None else ExitStack()
    pool = stack.enter_context(ConnectionPool(dsn, min_size=1, max_size=8, open=True))
    from django.core.wsgi import get_wsgi_application
    _django(dsn, stack)
    apps = {"flask": _flask(dsn, pool, False), "wsgi": _flask(dsn, pool, True),
            "django": get_wsgi_application()}
    apps["django-mw"] = apps["django"]

    def app(environ: dict[str, Any], start_response: Any) -> Any:
        first = environ.get("PATH_INFO", "").split("/")[1]
        return apps[first](environ, start_response)

    return app


# -- ASGI --------------------------------------------------------------------------------------

def asgi_app(dsn: str) -> Any:
    pool = AsyncConnectionPool(dsn, min_size=1, max_size=8, open=False)

    async def pay(request: Request) -> Response:
        body = await request.body()
        with psycopg.connect(dsn, autocommit=True) as conn:  # a short write, off the loop's way
            conn.execute("INSERT INTO calls VALUES ('asgi', %s)", (len(body),))
        intent = json.loads(body)["intent"]
        op = pg_asgi.get_operation(request)
        assert op is not None
        await op.conn.execute("INSERT INTO ledger VALUES (%s)", (intent,))
        return Response(_answer(intent), status_code=201, media_type="application/json")

    inner = Starlette(routes=[StarletteRoute("/asgi/pay", pay, methods=["POST"])])
    keyed = pg_asgi.IdempotencyMiddleware(inner, pool=pool, scope=lambda r: "acct",
                                          routes={"POST /asgi/pay": "required"})
    from django.core.asgi import get_asgi_application
    django_app = get_asgi_application()  # Django's settings: _django(), by serve()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/django"):
            await django_app(scope, receive, send)
        else:
            await keyed(scope, receive, send)

    return with_pool_lifespan(pool, app)


# -- servers -----------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _accepting(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


@contextmanager
def gunicorn(dsn: str, worker: str, app: str = "helpers.served:wsgi_app()",
             *options: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """gunicorn serving ``app`` with one worker of class ``worker`` (sync, gthread), in a
    process of its own; yields its base URL and the master process. Its log (what it printed)
    is in the assertion message when it does not start."""
    port = free_port()
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"gunicorn-{port}.log"
    env = dict(os.environ, PGIDEM_TEST_DSN=dsn,
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT / "harness"),
                                           os.environ.get("PYTHONPATH", "")]))
    threads = ["--threads", "4"] if worker == "gthread" else []
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "--bind", f"127.0.0.1:{port}", "--workers", "1",
             "--worker-class", worker, *threads, "--graceful-timeout", "5", "--timeout", "60",
             "--log-level", "warning", *options, app],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: _accepting(port) or proc.poll() is not None, "gunicorn to start")
        assert proc.poll() is None, log.read_text()
        # the worker imports the app after the master listens: wait for its first answer
        wait_until(lambda: _answers(port) or proc.poll() is not None, "gunicorn's worker")
        assert proc.poll() is None, log.read_text()
        yield f"http://127.0.0.1:{port}", proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(WAIT_BOUND)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(WAIT_BOUND)
        log.unlink(missing_ok=True)


def _answers(port: int) -> bool:
    try:
        httpx.get(f"http://127.0.0.1:{port}/flask/none", timeout=5)
        return True
    except httpx.HTTPError:
        return False


def worker_pids(master: int) -> list[int]:
    """The child processes of ``master`` (gunicorn's workers)."""
    children = Path(f"/proc/{master}/task/{master}/children").read_text().split()
    return [int(pid) for pid in children]


def vm_hwm_kb(pid: int) -> int:
    """The peak resident memory of process ``pid`` (VmHWM), in kB."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.M).group(1))  # type: ignore[union-attr]


@contextmanager
def waitress_server(app: Any, **options: Any) -> Iterator[str]:
    from waitress.server import create_server
    server = create_server(app, host="127.0.0.1", port=0, threads=4, **options)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.effective_port}"
    finally:
        server.close()
        thread.join(WAIT_BOUND)


@contextmanager
def serve(server: str, dsn: str) -> Iterator[str]:
    """The adapters (all of them) under ``server``; yields its base URL."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(TABLES)
    if server.startswith("gunicorn-"):
        with gunicorn(dsn, server.removeprefix("gunicorn-")) as (base, _):
            yield base
    elif server == "uvicorn":
        with ExitStack() as stack:
            _django(dsn, stack)
            with uvicorn_server(asgi_app(dsn)) as base:
                yield base
    else:
        with ExitStack() as stack:
            app = wsgi_app(dsn, stack)
            runner = waitress_server(app) if server == "waitress" else wsgi_server(app)
            with runner as base:
                yield base


# -- a raw client ------------------------------------------------------------------------------

def raw_exchange(base: str, request: bytes, *, half_close: bool = True) -> bytes:
    """Send ``request`` bytes as they are on a new connection, close the sending side (the
    client goes away, or has sent all it will), and read whatever the server answers until it
    closes: b"" when it answers nothing."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=WAIT_BOUND) as sock:
        sock.sendall(request)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        chunks = []
        started = time.monotonic()
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
                if time.monotonic() - started > WAIT_BOUND:
                    break
        except ConnectionResetError:
            pass
    return b"".join(chunks)


def status_of(answer: bytes) -> int | None:
    """The status code of a raw HTTP answer (None for no answer)."""
    if not answer:
        return None
    return int(answer.split(b" ", 2)[1])


def headers_block(path: str, key: str, extra: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Idempotency-Key: {key}\r\n{extra}Connection: close\r\n\r\n").encode()


def rows(dsn: str, adapter: str, key: str, intent: str) -> tuple[int, int, int]:
    """(key rows for ``key``, ledger rows for ``intent``, calls of ``adapter``'s handler)."""
    with psycopg.connect(dsn) as conn:
        return (conn.execute("SELECT count(*) FROM idempotency.keys WHERE key = %s",  # type: ignore[index]
                             (key,)).fetchone()[0],
                conn.execute("SELECT count(*) FROM ledger WHERE intent = %s",  # type: ignore[index]
                             (intent,)).fetchone()[0],
                conn.execute("SELECT count(*) FROM calls WHERE adapter = %s",  # type: ignore[index]
                             (adapter,)).fetchone()[0])


# -- a bare app: what a server answers before any app runs ------------------------------------

def plain_wsgi(environ: dict[str, Any], start_response: Any) -> Any:
    """Answers 200 "app ran" without reading the body: the request reached the app."""
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "7")])
    return [b"app ran"]


async def plain_asgi(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", b"7")]})
    await send({"type": "http.response.body", "body": b"app ran"})


@contextmanager
def _uvicorn_with(app: Any, **options: Any) -> Iterator[str]:
    """uvicorn serving ``app`` in a thread with ``options`` (uvicorn.Config's)."""
    import uvicorn
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off", **options))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), "uvicorn to start")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(WAIT_BOUND)


@contextmanager
def serve_plain(server: str, options: Any = None) -> Iterator[str]:
    """:func:`plain_wsgi` (or :func:`plain_asgi` for uvicorn) under ``server``, with each
    server's default limits, or ``options``: gunicorn's command-line options (a list), or
    keyword arguments of waitress's ``create_server`` or ``uvicorn.Config`` (a dict)."""
    if server.startswith("gunicorn-"):
        with gunicorn("", server.removeprefix("gunicorn-"), "helpers.served:plain_wsgi",
                      *(options or [])) as (base, _):
            yield base
    elif server == "uvicorn":
        with _uvicorn_with(plain_asgi, **(options or {})) as base:
            yield base
    elif server == "waitress":
        with waitress_server(plain_wsgi, **(options or {})) as base:
            yield base
    else:
        with wsgi_server(plain_wsgi) as base:
            yield base


def sent_in_parts(base: str, parts: list[bytes], pause: float = 0.3) -> bytes:
    """Send ``parts`` with a pause between them (a header still arriving), then read the
    answer until the server closes."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=WAIT_BOUND) as sock:
        try:
            for part in parts:
                sock.sendall(part)
                time.sleep(pause)
        except OSError:
            pass  # the server answered and closed before the rest: read its answer
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except OSError:
            pass
    return b"".join(chunks)
