#!/usr/bin/env python3
"""Benchmark: claim + complete through the engine vs a bare INSERT ... ON CONFLICT + UPDATE.

Three workloads run against the same throwaway server, interleaved round by round (bare, floor,
engine, bare, floor, engine ...), so machine noise hits them alike; what we report is each one's
ratio to bare per round, and the medians. This is a benchmark, not a test: it prints numbers and
asserts nothing.

  bare    the baseline: INSERT ... ON CONFLICT DO NOTHING + UPDATE on an unpartitioned table
  floor   the same two statements, each inside the thinnest PL/pgSQL function shaped like the
          engine's (bench/floor.sql): the ceiling for any PL/pgSQL implementation of the API
  engine  idempotency.claim + idempotency.complete

    .venv/bin/python bench/run.py [--servers pg15,pg18] [--modes durable,fast]
                                  [--seconds 10] [--rounds 3] [--clients 4,8] [--prefill 200000]
                                  [--json PATH]

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
import statistics
import sys
from pathlib import Path

import common
from common import BENCH, DURABLE, PSQL_FILE

import pgharness

SETUP_SQL = """
SELECT idempotency._premake(now() - interval '1 day');
CREATE TABLE bench_bare (LIKE idempotency.keys INCLUDING DEFAULTS, PRIMARY KEY (scope, key));
INSERT INTO idempotency.keys (scope, key, fingerprint, state, lease_token, created_at,
                              response_status, response_headers, response_body, completed_at)
SELECT 'acct_' || (g % 100), 'pre' || g, sha256(g::text::bytea), 'completed', g,
       now() - (g % 1440) * interval '1 minute', 201, '{}', '{"id": "ch_pre"}', now()
FROM generate_series(1, {prefill}) AS g;
INSERT INTO idempotency.key_directory (scope, key_hash, created_at)
SELECT scope, sha256(convert_to(key, 'UTF8')), created_at FROM idempotency.keys;
INSERT INTO bench_bare SELECT * FROM idempotency.keys;
VACUUM ANALYZE;
"""


def pgbench(server: pgharness.PgServer, script: Path, seconds: int, clients: int) -> float:
    return common.pgbench(server, server.dsn("bench"), [script], seconds, clients)


def run(flavour: str, mode: str, clients: int, args: argparse.Namespace) -> dict:
    conf = DURABLE if mode == "durable" else {}
    with pgharness.PgServer(pgharness.flavour_bindir(flavour), extra_conf=conf,
                            name=f"bench-{flavour}") as server:
        server.run_psql(server.dsn(), "CREATE DATABASE bench")
        common.install_engine(server, server.dsn("bench"))
        server.run_psql(server.dsn("bench"), SETUP_SQL.replace("{prefill}", str(args.prefill)))
        server.run_psql(server.dsn("bench"), BENCH / "floor.sql", args=PSQL_FILE)
        scripts = {name: BENCH / f"{name}.pgbench" for name in ("bare", "floor", "engine")}
        for script in scripts.values():  # warm up every side once
            pgbench(server, script, 2, clients)
        rounds = []
        for _ in range(args.rounds):
            tps = {name: pgbench(server, script, args.seconds, clients)
                   for name, script in scripts.items()}
            rounds.append(tps)
            print(f"  {flavour} {mode:7s} c={clients} bare {tps['bare']:7.0f} tps   "
                  f"floor {tps['floor']:7.0f} ({tps['floor'] / tps['bare']:.2f})   "
                  f"engine {tps['engine']:7.0f} ({tps['engine'] / tps['bare']:.2f})", flush=True)
        return {
            "flavour": flavour, "mode": mode, "clients": clients, "rounds": rounds,
            "engine_rounds": [r["engine"] / r["bare"] for r in rounds],
            "engine_over_floor_rounds": [r["engine"] / r["floor"] for r in rounds],
            "engine_over_floor": statistics.median(r["engine"] / r["floor"] for r in rounds),
            "version": common.version(server),
            "engine": statistics.median(r["engine"] / r["bare"] for r in rounds),
            "floor": statistics.median(r["floor"] / r["bare"] for r in rounds),
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default="pg15,pg18")
    parser.add_argument("--modes", default="durable,fast")
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", default="4", help="pgbench clients, e.g. 4,8")
    parser.add_argument("--prefill", type=int, default=200_000)
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()
    common.check_writable(parser, json=args.json)
    results = []
    for flavour in args.servers.split(","):
        for mode in args.modes.split(","):
            for clients in (int(c) for c in args.clients.split(",")):
                results.append(run(flavour, mode, clients, args))
    print("\nthroughput / bare INSERT ON CONFLICT + UPDATE, median of the rounds "
          f"({args.clients} clients, {args.rounds} x {args.seconds}s rounds, "
          f"{args.prefill} keys prefilled):")
    print(f"  {'server':<22s} {'mode':8s} {'clients':>7s} {'engine':>7s} {'floor':>7s} "
          f"{'engine/floor':>12s}")
    for r in results:
        print(f"  {r['version']:<22s} {r['mode']:8s} {r['clients']:7d} {r['engine']:7.2f} "
              f"{r['floor']:7.2f} {r['engine_over_floor']:12.2f}")
    print("engine: claim + complete through idempotency.*; floor: the bare statements inside "
          "minimal PL/pgSQL functions (bench/floor.sql), the ceiling for any PL/pgSQL design.")
    if args.json:
        common.write_json(args.json, {"seconds": args.seconds, "rounds": args.rounds,
                                      "prefill": args.prefill, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
