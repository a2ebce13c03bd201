#!/usr/bin/env python3
"""What one scrape of idempotency.metrics() costs against the number of stored keys.

    .venv/bin/python bench/metrics.py [--server pg18] [--rows 3000000] [--in-progress 1000]

Fills idempotency.keys with --rows completed keys over three daily partitions (responses of
about 60 bytes, as a payment API stores) plus --in-progress keys in progress, then times
metrics() (best and median of 9 calls, warm cache) and, for comparison, the parts it is made
of: the pass over the keys in progress (run alone, it may use parallel workers; inside
metrics() it runs serially), and the catalog-only gauges. Numbers:
docs/operations.md, "What a scrape costs".
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import common
import psycopg

import pgharness

FILL_SQL = """
SELECT idempotency._create_partition('keys', date_bin('1 day', now(), '2000-01-01 00:00+00')
                                     - d * interval '1 day',
                                     date_bin('1 day', now(), '2000-01-01 00:00+00')
                                     - (d - 1) * interval '1 day')
FROM generate_series(1, 2) AS d;
INSERT INTO idempotency.keys (scope, key, fingerprint, state, lease_token, created_at,
                              response_status, response_headers, response_body, completed_at)
SELECT 'acct_' || (g % 1000), 'k' || g, sha256(g::text::bytea), 'completed', g,
       now() - (g % 172800) * interval '1 second',
       201, '{}', '{"id": "ch_000000000000", "amount": 50, "currency": "EUR"}', now()
FROM generate_series(1, {rows}) AS g;
INSERT INTO idempotency.keys (scope, key, fingerprint, state, lease_token, lease_expires_at,
                              created_at)
SELECT 'acct_' || (g % 1000), 'p' || g, sha256(g::text::bytea), 'in_progress', g,
       now() + CASE WHEN g % 10 = 0 THEN interval '-1 minute' ELSE interval '1 minute' END,
       now() - (g % 3600) * interval '1 second'
FROM generate_series(1, {in_progress}) AS g;
VACUUM ANALYZE;
"""

QUERIES = {
    "metrics()": "SELECT * FROM idempotency.metrics()",
    "metrics(scan => false)": "SELECT * FROM idempotency.metrics(scan => false)",
    "metrics_by_scope()": "SELECT count(*) FROM idempotency.metrics_by_scope()",
    "the pass over keys in progress or released alone":
        "SELECT count(*), min(created_at) FROM idempotency.keys"
        " WHERE state IN ('in_progress', 'released')",
    "catalog gauges alone (n_live_tup, sizes)":
        "SELECT sum(pg_stat_get_live_tuples(i.inhrelid)), sum(pg_total_relation_size(i.inhrelid))"
        " FROM pg_inherits AS i WHERE i.inhparent = 'idempotency.keys'::regclass",
}


def timed(conn: psycopg.Connection, query: str, rounds: int = 9) -> list[float]:
    conn.execute(query).fetchall()  # warm
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        conn.execute(query).fetchall()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="pg18")
    parser.add_argument("--rows", type=int, default=3_000_000)
    parser.add_argument("--in-progress", type=int, default=1000)
    args = parser.parse_args()
    with pgharness.PgServer(pgharness.flavour_bindir(args.server),
                            name=f"bench-metrics-{args.server}") as server:
        dsn = server.dsn("postgres")
        common.install_engine(server, dsn)
        t0 = time.perf_counter()
        server.run_psql(dsn, FILL_SQL.replace("{rows}", str(args.rows))
                        .replace("{in_progress}", str(args.in_progress)))
        print(f"{server.version}: filled {args.rows} + {args.in_progress} keys in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
        with psycopg.connect(dsn, autocommit=True) as conn:
            size = conn.execute("SELECT total_bytes FROM idempotency.metrics()").fetchone()[0]
            print(f"stored: {size / 2**20:.0f} MB (keys, directory, inbox, tombstones)")
            print("| query | best | median |")
            print("|---|---|---|")
            for name, query in QUERIES.items():
                ms = timed(conn, query)
                print(f"| {name} | {min(ms):.1f} ms | {statistics.median(ms):.1f} ms |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
