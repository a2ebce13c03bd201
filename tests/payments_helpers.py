"""Shared by the HTTP tests: the example payments app, its lifespan, a real uvicorn server."""

from __future__ import annotations

import importlib.util
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import psycopg
import uvicorn

ROOT = Path(__file__).resolve().parent.parent


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
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def ledger_rows(dsn: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT account, amount, charge_id FROM ledger ORDER BY id").fetchall()
