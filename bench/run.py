#!/usr/bin/env python3
"""Benchmark: claim + complete through the engine vs a bare INSERT ... ON CONFLICT + UPDATE.

Both workloads run against the same throwaway server, interleaved round by round (A B A B ...),
so machine noise hits both alike; what we report is the ratio engine / bare per round and its
median. This is a benchmark, not a test: it prints numbers and asserts nothing.

    .venv/bin/python bench/run.py [--servers pg15,pg18] [--modes durable,fast]
                                  [--seconds 10] [--rounds 3] [--clients 4] [--prefill 200000]

Modes: "durable" is PostgreSQL's default (fsync, synchronous_commit and full_page_writes on),
as in production; "fast" turns all three off, which makes the run CPU-bound and shows the
functions' own cost at its most visible.

Setup, identical for both sides: the keys table has a day's worth of live partitions
(yesterday's and today's, plus the ones made ahead and the default one), and --prefill rows
are spread over yesterday and today, completed, in both the partitioned table and the bare
unpartitioned one.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import pgharness  # noqa: E402

DURABLE = {"fsync": "on", "synchronous_commit": "on", "full_page_writes": "on"}

BENCH = ROOT / "bench"

SETUP_SQL = """
SELECT idempotency._premake(now() - interval '1 day');
CREATE TABLE bench_bare (LIKE idempotency.keys INCLUDING DEFAULTS, PRIMARY KEY (scope, key));
INSERT INTO idempotency.keys (scope, key, fingerprint, state, lease_token, created_at,
                              response_status, response_headers, response_body, completed_at)
SELECT 'acct_' || (g % 100), 'pre' || g, sha256(g::text::bytea), 'completed', g,
       now() - (g % 1440) * interval '1 minute', 201, '{}', '{"id": "ch_pre"}', now()
FROM generate_series(1, {prefill}) AS g;
INSERT INTO bench_bare SELECT * FROM idempotency.keys;
VACUUM ANALYZE;
"""


def pgbench(server: pgharness.PgServer, script: Path, seconds: int, clients: int) -> float:
    out = subprocess.run(
        [str(server.bindir / "pgbench"), "-n", "-M", "prepared", "-c", str(clients),
         "-j", str(min(clients, 2)), "-T", str(seconds), "-f", str(script),
         server.dsn("bench")],
        capture_output=True, text=True, check=False,
    )
    match = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", out.stdout)
    if out.returncode != 0 or not match:
        raise SystemExit(f"pgbench failed:\n{out.stdout}\n{out.stderr}")
    return float(match.group(1))


def run(flavour: str, mode: str, args: argparse.Namespace) -> dict:
    conf = DURABLE if mode == "durable" else {}
    with pgharness.PgServer(pgharness.flavour_bindir(flavour), extra_conf=conf,
                            name=f"bench-{flavour}") as server:
        server.run_psql(server.dsn(), "CREATE DATABASE bench")
        for migration in sorted((ROOT / "migrations").glob("*.sql")):
            server.run_psql(server.dsn("bench"), migration,
                            args=("-X", "-q", "-1", "-v", "ON_ERROR_STOP=1"))
        server.run_psql(server.dsn("bench"), SETUP_SQL.replace("{prefill}", str(args.prefill)))
        engine, bare = BENCH / "engine.pgbench", BENCH / "bare.pgbench"
        pgbench(server, bare, 2, args.clients)  # warm up both sides once
        pgbench(server, engine, 2, args.clients)
        rounds = []
        for _ in range(args.rounds):
            b = pgbench(server, bare, args.seconds, args.clients)
            e = pgbench(server, engine, args.seconds, args.clients)
            rounds.append((b, e, e / b))
            print(f"  {flavour} {mode:7s} bare {b:9.0f} tps   engine {e:9.0f} tps   "
                  f"ratio {e / b:.2f}", flush=True)
        return {"flavour": flavour, "mode": mode, "version": server.version,
                "median_ratio": statistics.median(r[2] for r in rounds), "rounds": rounds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default="pg15,pg18")
    parser.add_argument("--modes", default="durable,fast")
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--prefill", type=int, default=200_000)
    args = parser.parse_args()
    results = []
    for flavour in args.servers.split(","):
        for mode in args.modes.split(","):
            results.append(run(flavour, mode, args))
    print("\nclaim + complete through idempotency.* / bare INSERT ON CONFLICT + UPDATE "
          f"({args.clients} clients, {args.rounds} x {args.seconds}s rounds, "
          f"{args.prefill} keys prefilled):")
    for r in results:
        print(f"  {r['version']:<40s} {r['mode']:8s} median ratio {r['median_ratio']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
