"""bench/floor_operation.sql, the PL/pgSQL floor that bench/operation.py --extra-sql measures
in place of the engine (docs/benchmarks.md): it must load on a current install and take the
package's own calls, or the floor's figures would silently stop being comparable."""

from __future__ import annotations

from pathlib import Path

import psycopg

import pg_idempotency as idem
from pgharness import PgServer

FLOOR = Path(__file__).resolve().parents[2] / "bench" / "floor_operation.sql"


def test_the_floor_takes_the_packages_calls(server: PgServer, db: str) -> None:
    server.run_psql(db, FLOOR, args=("-X", "-q", "-1", "-v", "ON_ERROR_STOP=1"))
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute("CREATE TABLE ledger (ref text, amount bigint)")
        for n in range(3):
            with idem.operation(conn, "acct_1", f"k{n}", {"amount": n}) as op:
                assert op.outcome == idem.Outcome.CLAIMED and op.lease_token == 1
                conn.execute("INSERT INTO ledger VALUES (%s, %s)", (f"k{n}", n))
                op.complete(201, {"id": n})
        # the floor's own table holds the three answers; the engine's tables none
        rows = conn.execute(
            "SELECT key, state, response_status, convert_from(response_body_bytes, 'UTF8')"
            " FROM idempotency.floor_keys ORDER BY key").fetchall()
        assert rows == [(f"k{n}", "completed", 201, f'{{"id":{n}}}') for n in range(3)]
        assert conn.execute("SELECT count(*) FROM idempotency.keys").fetchone()[0] == 0
        assert conn.execute("SELECT count(*) FROM ledger").fetchone()[0] == 3
