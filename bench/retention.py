#!/usr/bin/env python3
"""Benchmark: expiring one day of keys by partition drop (idempotency.maintain()) against a
batched DELETE, while claims keep coming.

For each method, on one throwaway server with PostgreSQL's durable defaults (fsync,
synchronous_commit and full_page_writes on): the keys partition of two days ago is filled with
--rows completed keys (today's partition with --rows / 10), VACUUM ANALYZE, CHECKPOINT; then
--clients sessions claim new keys in a loop while the old day is expired, and we measure

* the time the expiry takes,
* the WAL written meanwhile (pg_current_wal_lsn before and after), and an estimate of the
  claims' share of it (their WAL rate when they run alone, times the duration),
* the size of idempotency.keys (all partitions, indexes included) afterwards,
* claim latency (p50, p99, max) of the claims that ran while the expiry did, and of claims
  with no expiry running (the baseline).

"drop" is `SELECT * FROM idempotency.maintain()`. "delete" is what a table without partitions
would need: `DELETE ... WHERE (scope, key, created_at) IN (SELECT ... WHERE created_at <
cutoff LIMIT --batch)`, one transaction per batch until nothing is left, then (reported
separately) the VACUUM that makes the space reusable; the file does not shrink.

    .venv/bin/python bench/retention.py [--server pg15] [--rows 1000000] [--batch 10000]
                                        [--clients 2]

This is a benchmark, not a test: it prints numbers and asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import Any

import common
import psycopg

import pgharness

DURABLE = {**common.DURABLE, "max_wal_size": "4GB"}

FILL_SQL = """
SELECT idempotency._create_partition('keys', date_bin('1 day', now(), '2000-01-01 00:00+00')
                                     - interval '1 day',
                                     date_bin('1 day', now(), '2000-01-01 00:00+00'));
SELECT idempotency._create_partition('keys', date_bin('1 day', now(), '2000-01-01 00:00+00')
                                     - interval '2 days',
                                     date_bin('1 day', now(), '2000-01-01 00:00+00')
                                     - interval '1 day');
INSERT INTO idempotency.keys (scope, key, fingerprint, state, lease_token, created_at,
                              response_status, response_headers, response_body, completed_at)
SELECT 'acct_' || (g % 100), 'old' || g, sha256(g::text::bytea), 'completed', g,
       date_bin('1 day', now(), '2000-01-01 00:00+00') - interval '2 days'
           + (g % 86400) * interval '1 second',
       201, '{}', '{"id": "ch_old"}', now()
FROM generate_series(1, {rows}) AS g;
INSERT INTO idempotency.keys (scope, key, fingerprint, state, lease_token, created_at,
                              response_status, response_headers, response_body, completed_at)
SELECT 'acct_' || (g % 100), 'new' || g, sha256(g::text::bytea), 'completed', g,
       now() - (g % 3600) * interval '1 second', 201, '{}', '{"id": "ch_new"}', now()
FROM generate_series(1, {rows} / 10) AS g;
VACUUM ANALYZE;
CHECKPOINT;
"""

SIZE_SQL = """
SELECT coalesce(sum(pg_total_relation_size(i.inhrelid)), 0)::bigint
FROM pg_inherits AS i WHERE i.inhparent = 'idempotency.keys'::regclass
"""

DELETE_BATCH_SQL = """
DELETE FROM idempotency.keys
WHERE (scope, key, created_at) IN (
    SELECT k.scope, k.key, k.created_at FROM idempotency.keys AS k
    WHERE k.created_at < date_bin('1 day', now(), '2000-01-01 00:00+00') - interval '1 day'
    LIMIT %s
)
"""


class Claimers:
    """--clients sessions claiming fresh keys in a loop; records (start, end) of each claim."""

    def __init__(self, dsn: str, clients: int, tag: str) -> None:
        self.dsn, self.clients, self.tag = dsn, clients, tag
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def _run(self, n: int) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            i = 0
            while not self._stop.is_set():
                started = time.monotonic()
                conn.execute("SELECT outcome FROM idempotency.claim(%s, %s, '{\"a\": 1}')",
                             (f"acct_{n}", f"{self.tag}-{n}-{i}")).fetchone()
                ended = time.monotonic()
                with self._lock:
                    self.samples.append((started, ended))
                i += 1

    def __enter__(self) -> Claimers:
        self._threads = [threading.Thread(target=self._run, args=(n,), daemon=True)
                         for n in range(self.clients)]
        for t in self._threads:
            t.start()
        time.sleep(0.5)  # connected and warm
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)

    def latencies(self, start: float, end: float) -> list[float]:
        """Latencies (ms) of the claims that overlapped [start, end]."""
        with self._lock:
            return sorted((e - s) * 1000 for s, e in self.samples if s <= end and e >= start)


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def wal_lsn(conn: psycopg.Connection[Any]) -> str:
    return conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0]


def wal_since(conn: psycopg.Connection[Any], lsn: str) -> int:
    return int(conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", (lsn,)
                            ).fetchone()[0])


def fresh_db(server: pgharness.PgServer, name: str, rows: int) -> str:
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    dsn = server.dsn(name)
    common.install_engine(server, dsn)
    started = time.monotonic()
    server.run_psql(dsn, FILL_SQL.replace("{rows}", str(rows)))
    print(f"  {name}: {rows} + {rows // 10} keys loaded in {time.monotonic() - started:.0f} s",
          flush=True)
    return dsn


def measure(server: pgharness.PgServer, method: str, args: argparse.Namespace) -> dict:
    dsn = fresh_db(server, f"bench_{method}", args.rows)
    result: dict[str, Any] = {"method": method}
    with psycopg.connect(dsn, autocommit=True) as conn:
        result["size_before"] = conn.execute(SIZE_SQL).fetchone()[0]
        with Claimers(dsn, args.clients, method) as claims:
            # Baseline: claims alone for 3 s (also their WAL rate, subtracted below).
            lsn, t0 = wal_lsn(conn), time.monotonic()
            time.sleep(3)
            t1 = time.monotonic()
            base_wal_rate = wal_since(conn, lsn) / (t1 - t0)
            base = claims.latencies(t0, t1)

            lsn, start = wal_lsn(conn), time.monotonic()
            if method == "drop":
                steps = conn.execute("SELECT action, partition_name, row_count "
                                     "FROM idempotency.maintain() "
                                     "WHERE action = 'dropped' AND parent_table = 'keys'"
                                     ).fetchall()
                assert steps and steps[0][2] == args.rows, steps
            else:
                deleted = 0
                while True:
                    n = conn.execute(DELETE_BATCH_SQL, (args.batch,)).rowcount
                    deleted += n
                    if n == 0:
                        break
                assert deleted == args.rows, deleted
            end = time.monotonic()
            wal = wal_since(conn, lsn)
            claims_wal = base_wal_rate * (end - start)
            during = claims.latencies(start, end)
        result.update(
            seconds=end - start, wal=wal, claims_wal=claims_wal,
            size_after=conn.execute(SIZE_SQL).fetchone()[0],
            base_p50=pct(base, 50), base_p99=pct(base, 99), base_n=len(base),
            p50=pct(during, 50), p99=pct(during, 99), max=during[-1] if during else float("nan"),
            n=len(during))
        if method == "delete":
            started = time.monotonic()
            conn.execute("VACUUM idempotency.keys")
            result["vacuum_seconds"] = time.monotonic() - started
            result["size_after_vacuum"] = conn.execute(SIZE_SQL).fetchone()[0]
    return result


def mb(n: float) -> str:
    return f"{n / 1024 / 1024:.1f} MB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="pg15")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=10_000)
    parser.add_argument("--clients", type=int, default=2)
    args = parser.parse_args()
    with pgharness.PgServer(pgharness.flavour_bindir(args.server), extra_conf=DURABLE,
                            name=f"bench-retention-{args.server}") as server:
        print(f"{server.version}: expire one day of {args.rows} keys while {args.clients} "
              "sessions claim", flush=True)
        results = [measure(server, m, args) for m in ("drop", "delete")]
    print()
    print("| method | time | WAL written (of which claims, est.) | keys size before → after | "
          "claim p50 / p99 / max during (n) | claim p50 / p99 alone (n) |")
    print("|---|---|---|---|---|---|")
    for r in results:
        after = mb(r["size_after"])
        if "size_after_vacuum" in r:
            after += f" ({mb(r['size_after_vacuum'])} after a {r['vacuum_seconds']:.1f} s VACUUM)"
        print(f"| {r['method']} | {r['seconds']:.2f} s | {mb(r['wal'])} "
              f"({mb(r['claims_wal'])}) | "
              f"{mb(r['size_before'])} → {after} | "
              f"{r['p50']:.1f} / {r['p99']:.1f} / {r['max']:.1f} ms ({r['n']}) | "
              f"{r['base_p50']:.1f} / {r['base_p99']:.1f} ms ({r['base_n']}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
