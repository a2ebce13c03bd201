#!/usr/bin/env python3
"""Where the server time of claim + complete goes: per statement and per function.

Starts a throwaway server with ``pg_stat_statements`` (``track = all``, so the statements inside
the PL/pgSQL functions are counted too) and ``track_functions = all``, installs migrations/,
runs one pgbench workload for ``--seconds``, and prints the mean execution time per call of the
busiest statements (top-level and nested) and of every function (total, and its own time
without the functions it calls). CPU-bound ("fast": fsync, synchronous_commit and
full_page_writes off), pgbench ``-M prepared``.

Workloads (``--workload``):

  engine      bench/engine.pgbench: claim with a JSON request, complete with a JSON body
  middleware  what the ASGI middleware sends: claim with a 32-byte fingerprint, complete_bytes
  floor       bench/floor.pgbench: the bare statements in minimal PL/pgSQL functions
  bare        bench/bare.pgbench: INSERT ... ON CONFLICT + UPDATE on a plain table

``pg_stat_statements`` times a statement's execution, not its executor start-up and shut-down,
nor the PL/pgSQL around it: a function's own time minus its statements' is that rest. This is
a profile, not a benchmark: absolute numbers move with the machine's load, proportions less.

    .venv/bin/python bench/profile_sql.py [--workload middleware] [--server pg15]
                                          [--seconds 10] [--clients 2]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import psycopg  # noqa: E402

import pgharness  # noqa: E402

CONF = {"shared_preload_libraries": "pg_stat_statements", "pg_stat_statements.track": "all",
        "track_functions": "all", "fsync": "off", "synchronous_commit": "off",
        "full_page_writes": "off"}

MIDDLEWARE = r"""-- what the ASGI middleware sends (bench/profile_sql.py)
\set k random(1, 1000000000000)
SELECT lease_token AS tok FROM idempotency.claim('acct_1', 'k' || :k, NULL,
    fingerprint => sha256('POST /payments {"amount":50}'::bytea)) \gset
SELECT idempotency.complete_bytes('acct_1', 'k' || :k, :tok, 201, '\x7b7d'::bytea,
    'application/json', '{}');
"""

STATEMENTS = """
SELECT calls, round((total_exec_time / calls * 1000)::numeric, 1) AS us, toplevel,
       left(regexp_replace(query, '\\s+', ' ', 'g'), 110) AS query
FROM pg_stat_statements WHERE calls >= 100 AND query NOT LIKE '%pg_stat%'
ORDER BY total_exec_time DESC LIMIT 15
"""
FUNCTIONS = """
SELECT funcname, calls, round((total_time / calls * 1000)::numeric, 1) AS total_us,
       round((self_time / calls * 1000)::numeric, 1) AS self_us
FROM pg_stat_user_functions WHERE calls >= 100 ORDER BY total_time DESC
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="middleware",
                        choices=["engine", "middleware", "floor", "bare"])
    parser.add_argument("--server", default="pg15")
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--clients", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, pgharness.PgServer(
            pgharness.flavour_bindir(args.server), extra_conf=CONF, name="profile") as server:
        script = Path(tmp) / "workload.pgbench"
        if args.workload == "middleware":
            script.write_text(MIDDLEWARE)
        else:
            script.write_text((ROOT / "bench" / f"{args.workload}.pgbench").read_text())
        server.run_psql(server.dsn(), "CREATE DATABASE bench")
        db = server.dsn("bench")
        for migration in sorted((ROOT / "migrations").glob("*.sql")):
            server.run_psql(db, migration, args=("-X", "-q", "-1", "-v", "ON_ERROR_STOP=1"))
        server.run_psql(db, "CREATE EXTENSION pg_stat_statements; CREATE TABLE bench_bare "
                        "(LIKE idempotency.keys INCLUDING DEFAULTS, PRIMARY KEY (scope, key))")
        server.run_psql(db, ROOT / "bench" / "floor.sql",
                        args=("-X", "-q", "-v", "ON_ERROR_STOP=1"))

        def pgbench(seconds: int) -> str:
            out = subprocess.run(
                [str(server.bindir / "pgbench"), "-n", "-M", "prepared", "-c", str(args.clients),
                 "-j", str(min(args.clients, 2)), "-T", str(seconds), "-f", str(script), db],
                capture_output=True, text=True, check=False)
            match = re.search(r"tps = ([0-9.]+) \(without", out.stdout)
            if out.returncode != 0 or not match:
                raise SystemExit(f"pgbench failed:\n{out.stdout}\n{out.stderr}")
            return match.group(1)

        pgbench(2)  # warm up: compile the functions, fill the caches
        with psycopg.connect(db, autocommit=True) as conn:
            conn.execute("SELECT pg_stat_statements_reset()")
            conn.execute("SELECT pg_stat_reset()")
        tps = pgbench(args.seconds)
        with psycopg.connect(db, autocommit=True) as conn:
            print(f"{server.version.split(',')[0]}, workload {args.workload}, {args.clients} "
                  f"clients, {args.seconds} s: {float(tps):.0f} tps")
            print("\nstatements (µs per call; toplevel f = inside a function):")
            for calls, us, top, query in conn.execute(STATEMENTS):
                print(f"  {us:>7} µs  {calls:>7} calls  {'t' if top else 'f'}  {query}")
            print("\nfunctions (µs per call: total, own):")
            for name, calls, total, own in conn.execute(FUNCTIONS):
                print(f"  {name:<24s} {calls:>7} calls  {total:>7} µs  {own:>7} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
