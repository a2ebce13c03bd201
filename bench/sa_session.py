#!/usr/bin/env python3
"""Benchmark: ``pg_idempotency.sqlalchemy``'s operations on each driver, and psycopg's two
paths (the package's statements on the psycopg connection itself, or through SQLAlchemy's
``text()`` as every other driver gets them).

One session, one connection, one operation at a time (the cost per operation, not
concurrency): ``with operation(session, scope, key, request) as op:`` an ORM ``add`` of one
ledger row, ``op.complete(201, answer)``; fresh keys. Variants:

  sync-direct   Session on postgresql+psycopg, statements on the psycopg connection (default)
  sync-text     the same through text() (``PSYCOPG_DIRECT = False``)
  pg8000        Session on postgresql+pg8000 (text())
  async-direct  AsyncSession on postgresql+psycopg (async), statements on its connection
  async-text    the same through text()
  asyncpg       AsyncSession on postgresql+asyncpg (text())

They run interleaved, round by round, so the machine's noise hits them alike. Per
measurement (--seconds after --warmup): this process's CPU time per operation (app CPU: the
driver, SQLAlchemy, the package, the loop), the server's CPU per operation, operations per
second; per round the ratios text/direct and asyncpg/async-direct, and their medians.
PostgreSQL 15, default durability; the tree's package. A benchmark, not a test: it prints
numbers; exit status 1 only if a ledger is wrong.

    .venv/bin/python bench/sa_session.py [--rounds 5] [--seconds 3] [--warmup 0.5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import common
from common import PSQL_FILE

common.use_tree_package()

import psycopg  # noqa: E402
from sqlalchemy import String, create_engine  # noqa: E402
from sqlalchemy.ext.asyncio import create_async_engine  # noqa: E402
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column  # noqa: E402

import pg_idempotency.sqlalchemy as pg_sa  # noqa: E402
import pgharness  # noqa: E402

SCHEMA_SQL = "CREATE TABLE ledger (id serial PRIMARY KEY, ref text, account text, amount int)"
TRUNCATE_SQL = "TRUNCATE ledger, idempotency.keys, idempotency.key_directory"
CHECK_SQL = "SELECT count(*), count(DISTINCT ref) FROM ledger"
VARIANTS = ("sync-direct", "sync-text", "pg8000", "async-direct", "async-text", "asyncpg")
RATIOS = {"sync text/direct": ("sync-text", "sync-direct"),
          "async text/direct": ("async-text", "async-direct"),
          "asyncpg/async-direct": ("asyncpg", "async-direct"),
          "pg8000/sync-direct": ("pg8000", "sync-direct")}


class Base(DeclarativeBase):
    pass


class Ledger(Base):
    __tablename__ = "ledger"

    id: Mapped[int] = mapped_column(primary_key=True)
    ref: Mapped[str] = mapped_column(String)
    account: Mapped[str] = mapped_column(String)
    amount: Mapped[int]


def payment(n: int) -> tuple[str, dict[str, Any]]:
    account = f"acct_{n % 10}"
    return account, {"amount": 1000 + n % 9000, "currency": "EUR", "account": account,
                     "metadata": {"order_id": f"ord_{n}", "tags": ["renewal"]}}


def url(dsn: str, driver: str) -> str:
    return f"postgresql+{driver}://" + dsn.split("://", 1)[1]


def run_sync(dsn: str, driver: str, tag: str, warmup: float, seconds: float, server: Any
             ) -> tuple[int, float, float, int]:
    engine = create_engine(url(dsn, driver))
    n = 0
    try:
        with Session(engine) as session:
            def one() -> None:
                nonlocal n
                n += 1
                scope, request = payment(n)
                key = f"{tag}-{n}"
                with pg_sa.operation(session, scope, key, request) as op:
                    session.add(Ledger(ref=key, account=scope, amount=request["amount"]))
                    op.complete(201, {"id": key, "status": "succeeded"})

            end = time.perf_counter() + warmup
            while time.perf_counter() < end:
                one()
            n0, cpu0, pg0, t0 = n, time.process_time(), common.server_cpu(server), \
                time.perf_counter()
            while time.perf_counter() < t0 + seconds:
                one()
            # the server's CPU while the backend is alive (dispose() ends it)
            return n - n0, time.process_time() - cpu0, time.perf_counter() - t0, \
                common.cpu_delta(pg0, common.server_cpu(server))
    finally:
        engine.dispose()


async def run_async(dsn: str, driver: str, tag: str, warmup: float, seconds: float,
                    server: Any) -> tuple[int, float, float, int]:
    from sqlalchemy.ext.asyncio import AsyncSession

    engine = create_async_engine(url(dsn, driver))
    n = 0
    try:
        async with AsyncSession(engine, expire_on_commit=False) as session:
            async def one() -> None:
                nonlocal n
                n += 1
                scope, request = payment(n)
                key = f"{tag}-{n}"
                async with pg_sa.aoperation(session, scope, key, request) as op:
                    session.add(Ledger(ref=key, account=scope, amount=request["amount"]))
                    await op.complete(201, {"id": key, "status": "succeeded"})

            end = time.perf_counter() + warmup
            while time.perf_counter() < end:
                await one()
            n0, cpu0, pg0, t0 = n, time.process_time(), common.server_cpu(server), \
                time.perf_counter()
            while time.perf_counter() < t0 + seconds:
                await one()
            return n - n0, time.process_time() - cpu0, time.perf_counter() - t0, \
                common.cpu_delta(pg0, common.server_cpu(server))
    finally:
        await engine.dispose()


def measure(server: Any, dsn: str, admin: psycopg.Connection[Any], variant: str, tag: str,
            args: argparse.Namespace) -> dict[str, float]:
    admin.execute(TRUNCATE_SQL)
    pg_sa.PSYCOPG_DIRECT = not variant.endswith("-text")
    if variant in ("sync-direct", "sync-text", "pg8000"):
        driver = "pg8000" if variant == "pg8000" else "psycopg"
        n, cpu, wall, ticks = run_sync(dsn, driver, tag, args.warmup, args.seconds, server)
    else:
        driver = "asyncpg" if variant == "asyncpg" else "psycopg"
        n, cpu, wall, ticks = asyncio.run(run_async(dsn, driver, tag, args.warmup,
                                                       args.seconds, server))
    rows, distinct = admin.execute(CHECK_SQL).fetchone()
    total = max(n, 1)
    return {"app_cpu_ms": cpu * 1000 / total, "ops": n / wall,
            "pg_cpu_ms": ticks * 1000 / common.clock_ticks() / total,
            "ok": float(rows == distinct)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=0.5)
    parser.add_argument("--server", default="pg15", help="pgharness flavour (pg15, pg18)")
    args = parser.parse_args()
    with pgharness.PgServer(pgharness.flavour_bindir(args.server),
                            name="bench-sa-session") as server:
        server.run_psql(server.dsn(), "CREATE DATABASE bench")
        dsn = server.dsn("bench")
        common.install_engine(server, dsn)
        server.run_psql(dsn, SCHEMA_SQL, args=PSQL_FILE)
        print(f"{common.version(server)}, no fsync; one session, fresh keys; "
              f"{args.rounds} round(s) x {args.seconds:g}s after {args.warmup:g}s warm-up",
              flush=True)
        rounds: list[dict[str, dict[str, float]]] = []
        bad = 0
        with psycopg.connect(dsn, autocommit=True) as admin:
            for r in range(args.rounds):
                per = {v: measure(server, dsn, admin, v, f"{v}-{r}", args) for v in VARIANTS}
                bad += sum(res["ok"] != 1.0 for res in per.values())
                rounds.append(per)
                print(f"round {r + 1}: " + "; ".join(
                    f"{v} {res['app_cpu_ms']:.3f} ms app, {res['pg_cpu_ms']:.3f} ms pg, "
                    f"{res['ops']:.0f}/s" for v, res in per.items()), flush=True)
        print("\nmedians (app CPU ms per operation):")
        for v in VARIANTS:
            print(f"  {v:13} {statistics.median(r[v]['app_cpu_ms'] for r in rounds):.3f} ms"
                  f"  (server {statistics.median(r[v]['pg_cpu_ms'] for r in rounds):.3f} ms,"
                  f" {statistics.median(r[v]['ops'] for r in rounds):.0f}/s)")
        print("ratios of app CPU per operation, per round, and their median:")
        for name, (a, b) in RATIOS.items():
            values = [r[a]["app_cpu_ms"] / r[b]["app_cpu_ms"] for r in rounds]
            print(f"  {name:22} {common.rounds_text(values)}  median "
                  f"{statistics.median(values):.2f}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
