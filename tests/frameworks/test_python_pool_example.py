"""docs/python.md's "Over a pool" example, run as written by the application's role: a pool of
2 carries 8 payments parked in their provider call (none holds a connection meanwhile), each
is written once, and the same keys replay the stored answers without calling the provider."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg
import pytest
from helpers import doc_block, login_roles
from psycopg.conninfo import make_conninfo
from psycopg_pool import AsyncConnectionPool

from pgharness import WAIT_BOUND, PgServer

EXAMPLE = doc_block("python.md", "python", "from pg_idempotency import aio\n\nasync def pay(pool")
LEDGER = "CREATE TABLE ledger (account_id text, charge_id text, amount int)"


class Provider:
    """A payment provider whose charges wait on ``gate``: the provider call in progress."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.calls: list[str] = []

    async def charge(self, key: str, amount: int) -> Any:
        self.calls.append(key)
        await self.gate.wait()
        return type("Charge", (), {"id": f"ch_{uuid.uuid4().hex[:12]}"})()


@pytest.mark.anyio
async def test_the_pooled_example_holds_no_connection_in_the_provider_call(
    server: PgServer, db: str
) -> None:
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute(LEDGER)
    with login_roles(server, db, "request") as (role,):
        with psycopg.connect(db, autocommit=True) as conn:
            conn.execute(f'GRANT SELECT, INSERT ON ledger TO "{role}"')
        scope: dict[str, Any] = {}
        exec(EXAMPLE, scope)  # noqa: S102 - the page's code, as written
        pay = scope["pay"]
        provider = Provider()
        pool = AsyncConnectionPool(make_conninfo(db, user=role), min_size=2, max_size=2,
                                   timeout=WAIT_BOUND, open=False)
        await pool.open(wait=True)
        try:
            keys = [f"k{i}" for i in range(8)]
            parked = [asyncio.create_task(pay(pool, provider, "acct_1", k, {"amount": 5}))
                      for k in keys]
            for _ in range(int(WAIT_BOUND / 0.01)):
                if len(provider.calls) == 8:
                    break
                await asyncio.sleep(0.01)
            assert len(provider.calls) == 8
            stats = pool.get_stats()
            assert stats["pool_available"] == 2 and stats["requests_waiting"] == 0, stats
            provider.gate.set()
            answers = await asyncio.gather(*parked)
            assert [status for status, _ in answers] == [201] * 8
            replays = await asyncio.gather(*(pay(pool, provider, "acct_1", k, {"amount": 5})
                                              for k in keys))
            assert replays == answers
            assert len(provider.calls) == 8  # a replay never calls the provider
        finally:
            await pool.close()
    with psycopg.connect(db) as conn:
        rows = conn.execute("SELECT charge_id FROM ledger ORDER BY charge_id").fetchall()
    assert sorted(answer["charge"] for _, answer in answers) == [r[0] for r in rows]
