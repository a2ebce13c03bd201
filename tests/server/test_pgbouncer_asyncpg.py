"""asyncpg through a real pgbouncer (Debian's 1.18) in transaction mode, with the setting the
docs give (``statement_cache_size=0``: asyncpg names no prepared statement): 32 asyncpg
clients racing through 4 server connections for 40 keys with ``aio.operation()`` (claim, a
write, a checkpoint, another write, complete) get one execution per key, its two writes, and
every retry the stored answer. With asyncpg's default statement cache the same race fails
(named statements land on other clients' server connections), which shows that it can tell.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Iterator
from typing import Any

import asyncpg
import psycopg
import pytest

from pg_idempotency import aio
from pg_idempotency.errors import KeyInProgress
from pgharness import WAIT_BOUND, PgBouncer, PgServer

# Needs (tests/README.md): Debian's pgbouncer.
pytestmark = [pytest.mark.pgbouncer, pytest.mark.anyio]

APP_ROLE = "idem_bouncer_asyncpg"
CLIENTS = 32
KEYS = 40


@pytest.fixture
def bouncer_db(server: PgServer, db: str) -> Iterator[tuple[PgBouncer, str]]:
    dbname = db.rsplit("/", 1)[1]
    with psycopg.connect(db, autocommit=True) as conn:
        if conn.execute("SELECT NOT EXISTS (SELECT FROM pg_roles WHERE rolname = %s)",
                        (APP_ROLE,)).fetchone()[0]:
            conn.execute(f"CREATE ROLE {APP_ROLE} LOGIN")
        conn.execute("SELECT idempotency.grant_usage(%s, 'request')", (APP_ROLE,))
        conn.execute("SELECT idempotency._premake()")
        conn.execute("CREATE TABLE public.orders (key text, step text)")
        conn.execute(f"GRANT INSERT, SELECT ON public.orders TO {APP_ROLE}")
    with PgBouncer(server, users=["postgres", APP_ROLE], pool_mode="transaction",
                   pool_size=4) as bouncer:
        yield bouncer, dbname


async def race(bouncer: PgBouncer, dbname: str, **connect: Any) -> tuple[Counter[str], list[str]]:
    outcomes: Counter[str] = Counter()
    failures: list[str] = []
    dsn = bouncer.dsn(dbname, user=APP_ROLE)

    async def client(i: int) -> None:
        rng = random.Random(i)
        conn = await asyncpg.connect(dsn, **connect)
        try:
            for _ in range(KEYS):
                key = f"k{rng.randrange(KEYS)}"
                try:
                    async with aio.operation(conn, "bounce", key, {"key": key},
                                             lease=WAIT_BOUND) as op:
                        if op.replay is not None:
                            assert op.replay.json() == {"key": key}
                            outcomes["replay"] += 1
                            continue
                        await conn.execute("INSERT INTO orders VALUES ($1, 'one')", key)
                        await op.checkpoint("one")
                        await conn.execute("INSERT INTO orders VALUES ($1, 'two')", key)
                        await op.complete(201, {"key": key})
                        outcomes["executed"] += 1
                except KeyInProgress:
                    outcomes["in_progress"] += 1
                except Exception as exc:  # noqa: BLE001 - counted: the test says which
                    failures.append(f"{type(exc).__name__}: {exc}")
        finally:
            await conn.close()

    await asyncio.gather(*(client(i) for i in range(CLIENTS)))
    return outcomes, failures


async def test_32_asyncpg_clients_through_pgbouncer_without_a_statement_cache(
        bouncer_db: tuple[PgBouncer, str], db: str) -> None:
    bouncer, dbname = bouncer_db
    outcomes, failures = await race(bouncer, dbname, statement_cache_size=0)
    assert failures == []
    with psycopg.connect(db) as conn:
        written = conn.execute(
            "SELECT key, array_agg(step ORDER BY step) FROM orders GROUP BY key").fetchall()
        completed = conn.execute(
            "SELECT count(*) FROM idempotency.keys WHERE state = 'completed'").fetchone()[0]
    assert all(steps == ["one", "two"] for _, steps in written), written
    assert outcomes["executed"] == len(written) == completed
    assert outcomes["replay"] > 0


async def test_the_race_fails_with_asyncpgs_default_statement_cache(
        bouncer_db: tuple[PgBouncer, str]) -> None:
    bouncer, dbname = bouncer_db
    _outcomes, failures = await race(bouncer, dbname)
    assert failures, "asyncpg's named statements went through a transaction-mode pooler"
    assert any("prepared statement" in f for f in failures), failures[:5]
