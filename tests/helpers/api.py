"""Running the Python API both ways (sync and async) and the installed console script."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg

from pg_idempotency import aio
from pgharness import WAIT_BOUND

CLI = Path(sys.executable).parent / "pg-idempotency"


async def call(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def is_asyncpg(conn: Any) -> bool:
    return type(conn).__module__.partition(".")[0] == "asyncpg"


async def execute(conn: Any, sql: str, *args: Any) -> None:
    """One statement with psycopg's ``%s`` placeholders on a psycopg connection (sync or
    async) or asyncpg's (``$1``, ``$2`` ...)."""
    if is_asyncpg(conn):
        n = iter(range(1, len(args) + 1))
        await conn.execute(re.sub("%s", lambda _: f"${next(n)}", sql), *args)
    else:
        await call(conn.execute(sql, args or None))


async def rollback(conn: Any) -> None:
    """Roll back what is open on a psycopg or asyncpg connection."""
    if is_asyncpg(conn):
        if conn.is_in_transaction():
            await conn.execute("ROLLBACK")
    else:
        await call(conn.rollback())


def idle(conn: Any) -> bool:
    """No transaction is open on ``conn`` (psycopg's or asyncpg's)."""
    if is_asyncpg(conn):
        return not conn.is_in_transaction()
    return conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


class _enter:
    """``async with _enter(op)`` for either flavour's Operation."""

    def __init__(self, op: Any) -> None:
        self.op = op

    async def __aenter__(self) -> Any:
        if isinstance(self.op, aio.Operation):
            return await self.op.__aenter__()
        return self.op.__enter__()

    async def __aexit__(self, *exc: Any) -> Any:
        if isinstance(self.op, aio.Operation):
            return await self.op.__aexit__(*exc)
        return self.op.__exit__(*exc)


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items()
            if k != "DATABASE_URL" and not k.startswith("PG")}
    base["LC_ALL"] = "C"
    return subprocess.run([str(CLI), *args], capture_output=True, text=True, timeout=WAIT_BOUND,
                          env={**base, **(env or {})}, stdin=subprocess.DEVNULL)
