#!/usr/bin/env python3
"""Benchmark: what it costs that the package never prepares its statements.

claim + complete through ``operation()`` (claim in autocommit; complete and COMMIT in one
pipeline), one connection with psycopg's default ``prepare_threshold`` (5), two ways:

  unprepared  the package as shipped: every statement with ``prepare=False`` (unnamed)
  prepared    ``core._PREPARE = None``: psycopg's default, so claim and complete become named
              prepared statements after 5 executions (what 0.8.0 did, unsafe behind
              transaction-mode pgbouncer)

Each side has a connection of its own, open throughout, and the two take turns call by call
(the order alternates too), so machine noise hits both alike (on a shared machine, rounds of
seconds a side gave ratios from 0.5 to 1.3). A round is --pairs calls a side; the result is
each round's ratio unprepared / prepared in claim+complete per second (the time spent by the
prepared side over the unprepared side's), and the median and quartiles of the ratios. A
benchmark, not a test: it prints numbers and asserts nothing.

    .venv/bin/python bench/prepare.py [--servers pg18] [--modes fast,durable]
                                      [--pairs 100] [--rounds 30]

Modes: "durable" is PostgreSQL's default (fsync, synchronous_commit, full_page_writes on);
"fast" turns them off, which makes the loop CPU-bound and shows parse and plan at their most
visible.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid

import psycopg
from common import DURABLE

import pg_idempotency as idem
import pgharness
from pg_idempotency import core
from pg_idempotency.migrate import migrate


def one(conn: psycopg.Connection, prepared: bool, key: str) -> float:
    """Seconds for one claim + complete on ``conn``, preparing or not."""
    core._PREPARE = None if prepared else False
    try:
        t0 = time.perf_counter()
        with idem.operation(conn, "bench", key, {"key": key, "amount": "12.50"}) as op:
            op.complete(201, {"id": key})
        return time.perf_counter() - t0
    finally:
        core._PREPARE = False


def run(flavour: str, mode: str, args: argparse.Namespace) -> dict:
    conf = DURABLE if mode == "durable" else {}
    with pgharness.PgServer(pgharness.flavour_bindir(flavour), extra_conf=conf,
                            name=f"bench-prepare-{flavour}") as server:
        server.run_psql(server.dsn(), "CREATE DATABASE bench")
        dsn = server.dsn("bench")
        with psycopg.connect(dsn, autocommit=True) as conn:
            migrate(conn)
            conn.execute("SELECT idempotency._premake()")
        # One connection per side, both open throughout: the prepared side's statements stay
        # prepared, the other's are parsed and planned every time.
        with psycopg.connect(dsn, autocommit=True) as plain, \
                psycopg.connect(dsn, autocommit=True) as preparing:
            assert plain.prepare_threshold == preparing.prepare_threshold == 5
            tag = uuid.uuid4().hex[:8]
            for n in range(20):  # past the threshold, and warm caches
                one(plain, False, f"{tag}-w{n}")
                one(preparing, True, f"{tag}-W{n}")
            ratios, rates = [], {False: [], True: []}
            for i in range(args.rounds):
                spent = {False: 0.0, True: 0.0}
                for n in range(args.pairs):  # one call each, alternating, the order too
                    for p in ((False, True) if n % 2 == 0 else (True, False)):
                        spent[p] += one(preparing if p else plain, p, f"{tag}-{i}-{n}-{p:d}")
                for p in spent:
                    rates[p].append(args.pairs / spent[p])
                ratios.append(spent[True] / spent[False])  # = rate unprepared / rate prepared
            counted = "SELECT count(*) FROM pg_prepared_statements"
            assert plain.execute(counted, prepare=False).fetchone()[0] == 0
            assert preparing.execute(counted, prepare=False).fetchone()[0] >= 2
        result = {"flavour": flavour, "mode": mode, "version": server.version.split()[1],
                  "median": statistics.median(ratios),
                  "q1": statistics.quantiles(ratios, n=4)[0],
                  "q3": statistics.quantiles(ratios, n=4)[2],
                  "plain": statistics.median(rates[False]),
                  "prepared": statistics.median(rates[True])}
        print(f"  {flavour} {mode:7s}: unprepared {result['plain']:6.0f}/s  prepared "
              f"{result['prepared']:6.0f}/s (medians)  ratio median {result['median']:.3f} "
              f"(quartiles {result['q1']:.3f}-{result['q3']:.3f})", flush=True)
        return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default="pg18")
    parser.add_argument("--modes", default="fast,durable")
    parser.add_argument("--pairs", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    results = [run(f, m, args) for f in args.servers.split(",") for m in args.modes.split(",")]
    print(f"\nclaim+complete per second, unprepared / prepared, one connection each, "
          f"{args.rounds} rounds of {args.pairs} alternating calls a side:")
    for r in results:
        print(f"  PostgreSQL {r['version']:<6s} {r['mode']:8s} median {r['median']:.3f} "
              f"(quartiles {r['q1']:.3f}-{r['q3']:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
