"""Shared by the HTTP tests: the example payments app, its lifespan, an ASGI app's pool
lifespan, a real uvicorn server, a threaded WSGI server."""

from __future__ import annotations

import importlib.util
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from types import ModuleType
from typing import Any

import psycopg
import uvicorn
from django.core.servers.basehttp import ThreadedWSGIServer, WSGIRequestHandler
from psycopg_pool import AsyncConnectionPool
from werkzeug.serving import make_server

from helpers import ROOT
from pgharness import WAIT_BOUND, wait_until


def load_example() -> ModuleType:
    path = ROOT / "examples" / "payments" / "app.py"
    spec = importlib.util.spec_from_file_location("payments_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


payments = load_example()


@asynccontextmanager
async def lifespan(app: Any) -> AsyncIterator[Any]:
    """Run the app's lifespan (httpx's ASGI transport does not)."""
    async with app.router.lifespan_context(app):
        yield app


ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]


def with_pool_lifespan(pool: AsyncConnectionPool, app: ASGIApp) -> ASGIApp:
    """``app`` behind a lifespan that opens ``pool`` at startup and closes it at shutdown
    (as a deployed app would; uvicorn runs the lifespan, httpx's ASGI transport does not)."""

    async def wrapped(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await receive()
            await pool.open()
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await pool.close()
            await send({"type": "lifespan.shutdown.complete"})
            return
        await app(scope, receive, send)

    return wrapped


@contextmanager
def uvicorn_server(app: Any) -> Iterator[str]:
    """Serve ``app`` with uvicorn on 127.0.0.1 in a thread; yields its base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), "uvicorn to start")
    assert server.started, "uvicorn stopped before it started serving"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(WAIT_BOUND)
    assert not thread.is_alive(), "uvicorn did not stop"


def ledger_rows(dsn: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT account, amount, charge_id FROM ledger ORDER BY id").fetchall()


@contextmanager
def wsgi_server(app: Any, django: bool = False) -> Iterator[str]:
    if django:
        server: Any = ThreadedWSGIServer(("127.0.0.1", 0), WSGIRequestHandler,
                                         allow_reuse_address=True)
        server.set_app(app)
        server.daemon_threads = True
    else:
        server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(WAIT_BOUND)
