#!/usr/bin/env python3
"""Benchmark: what it costs that the package never prepares its statements (issue 23, item 8).

claim + complete through ``operation()`` (claim in autocommit; complete and COMMIT in one
pipeline), one connection with psycopg's default ``prepare_threshold`` (5), two ways:

  unprepared  the package as shipped: every statement with ``prepare=False`` (unnamed)
  prepared    ``core._PREPARE = None``: psycopg's default, so claim and complete become named
              prepared statements after 5 executions (what 0.8.0 did, unsafe behind
              transaction-mode pgbouncer)

Each side has a connection of its own, open throughout; short rounds alternate between them
(the order alternates too), so machine noise hits both alike; the result is each round's
ratio unprepared / prepared in claim+complete per second, and the median and quartiles of the
ratios. A benchmark, not a test: it prints numbers and asserts nothing.

    .venv/bin/python bench/prepare.py [--servers pg18] [--modes fast,durable]
                                      [--seconds 0.5] [--rounds 60]

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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import psycopg  # noqa: E402

import pg_idempotency as idem  # noqa: E402
import pgharness  # noqa: E402
from pg_idempotency import core  # noqa: E402
from pg_idempotency.migrate import migrate  # noqa: E402

DURABLE = {"fsync": "on", "synchronous_commit": "on", "full_page_writes": "on"}


def block(conn: psycopg.Connection, prepared: bool, seconds: float) -> float:
    """claim + complete per second on ``conn`` for ``seconds``, preparing or not."""
    core._PREPARE = None if prepared else False
    try:
        tag = uuid.uuid4().hex[:8]
        n = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            with idem.operation(conn, "bench", f"{tag}-{n}", {"n": n, "amount": "12.50"}) as op:
                op.complete(201, {"id": n})
            n += 1
        return n / (time.perf_counter() - t0)
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
            block(plain, False, 1)
            block(preparing, True, 1)  # past the threshold, and warm caches
            ratios, rates = [], {False: [], True: []}
            for i in range(args.rounds):
                order = (False, True) if i % 2 == 0 else (True, False)
                got = {p: block(preparing if p else plain, p, args.seconds) for p in order}
                for p in got:
                    rates[p].append(got[p])
                ratios.append(got[False] / got[True])
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
    parser.add_argument("--seconds", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=60)
    args = parser.parse_args()
    results = [run(f, m, args) for f in args.servers.split(",") for m in args.modes.split(",")]
    print(f"\nclaim+complete per second, unprepared / prepared, one connection each, "
          f"{args.rounds} interleaved rounds of {args.seconds}s a side:")
    for r in results:
        print(f"  PostgreSQL {r['version']:<6s} {r['mode']:8s} median {r['median']:.3f} "
              f"(quartiles {r['q1']:.3f}-{r['q3']:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
