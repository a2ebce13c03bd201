#!/usr/bin/env python3
"""Benchmark: the README's ``operation()`` pattern against the recipe a user writes with
psycopg's defaults, and against no idempotency.

Every variant runs --threads threads in one Python process, each with a connection of its own
(autocommit, psycopg's default ``prepare_threshold``), in a loop of payments: a small payment
request with nested metadata, one ledger INSERT, a small JSON answer. PostgreSQL 15, default
durability (fsync, synchronous_commit, full_page_writes on), the engine installed from
migrations/ (the tree's package, not the venv's, is imported).

  none    BEGIN; the ledger INSERT; COMMIT (psycopg's ``conn.transaction()``)
  recipe  ``INSERT INTO recipe_keys ... ON CONFLICT DO NOTHING RETURNING`` (autocommit, the
          request's sha256 of its sorted JSON beside the key); then BEGIN; the ledger INSERT;
          ``UPDATE recipe_keys SET`` the answer (jsonb) ``WHERE`` the key; COMMIT: five
          statements. No lease, no expiry, no fencing, no mismatch check: what a user writes.
  ours    ``with idem.operation(conn, scope, key, request) as op:`` the ledger INSERT on
          ``op.conn``; ``op.complete(201, answer)``: claim, BEGIN, the INSERT, complete and
          COMMIT, the same five statements (complete and COMMIT in one round trip)

Every request has a fresh key. The variants run interleaved, round by round (none, recipe,
ours, none, ...), so the machine's noise hits them alike. In each measurement the tables are
truncated, the threads warm up for --warmup seconds, then, over the next --seconds, we count
the payments done and take:

  server CPU  the CPU ticks of every process of the server (bench/common.py, /proc: the
              backends, WAL writer, checkpointer ...) per payment
  app CPU     this Python process's CPU time (``time.process_time()``, every thread) per
              payment: the client library, the package and the loop; the loop's own share is
              the "none" column
  throughput  payments per second

and per round ours / recipe and ours / none of each, and their medians. The ledger is checked
after every measurement (one row per payment, no key twice). A benchmark, not a test: it
prints numbers; its exit status is 1 only if a ledger is wrong.

    .venv/bin/python bench/operation.py [--rounds 5] [--seconds 5] [--warmup 1] [--threads 4]
                                        [--json PATH] [--baseline DIR]

--extra-sql FILE runs FILE after the migrations, as the owner: an experiment on the engine (a
function replaced, say; bench/floor_operation.sql puts the PL/pgSQL floor in place of claim and
complete_bytes), measured through the same package calls.

--baseline DIR adds a fourth variant, ``base``: the same ``operation()`` pattern with the
package in DIR/pg_idempotency (e.g. ``git archive`` of an earlier commit's python/), in the
same rounds, and prints ours / base per round: a change to the package measured against its
predecessor under the same noise.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import common
from common import DURABLE, PSQL_FILE, PSQL_ONE_TX

common.use_tree_package()

import psycopg  # noqa: E402
from psycopg.types.json import Jsonb  # noqa: E402

import pg_idempotency as idem  # noqa: E402
import pgharness  # noqa: E402

VARIANTS = ("none", "recipe", "ours")
SCHEMA_SQL = """
CREATE TABLE ledger (ref text, account text, amount bigint, currency text);
CREATE TABLE recipe_keys (
    scope text, key text, request_hash bytea, status text,
    response_code int, response_body jsonb,
    PRIMARY KEY (scope, key)
);
"""
TRUNCATE_SQL = ("TRUNCATE ledger, recipe_keys, idempotency.keys, idempotency.key_directory")
CHECK_SQL = "SELECT count(*), count(DISTINCT ref) FROM ledger"
INSERT_LEDGER = ("INSERT INTO ledger (ref, account, amount, currency) "
                 "VALUES (%s, %s, %s, %s)")
RECIPE_CLAIM = ("INSERT INTO recipe_keys (scope, key, request_hash, status) "
                "VALUES (%s, %s, %s, 'in_progress') ON CONFLICT DO NOTHING RETURNING 1")
RECIPE_COMPLETE = ("UPDATE recipe_keys SET status = 'completed', response_code = %s, "
                   "response_body = %s WHERE scope = %s AND key = %s")


def payment(i: int, n: int) -> tuple[str, dict[str, Any]]:
    """The account (the scope) and a small payment request with nested metadata."""
    account = f"acct_{i % 10}"
    return account, {
        "amount": 1000 + n % 9000, "currency": "EUR", "account": account,
        "description": f"Order #{n}",
        "metadata": {"order_id": f"ord_{i}_{n}", "channel": "web",
                     "customer": {"id": f"cus_{n % 500}", "tier": "gold"},
                     "tags": ["subscription", "renewal"]},
    }


def answer(key: str, request: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"pay_{key}", "status": "succeeded", "amount": request["amount"],
            "currency": request["currency"]}


def do_none(conn: psycopg.Connection[Any], key: str, scope: str, request: dict[str, Any]
            ) -> None:
    with conn.transaction():
        conn.execute(INSERT_LEDGER, (key, scope, request["amount"], request["currency"]))
    answer(key, request)


def do_recipe(conn: psycopg.Connection[Any], key: str, scope: str, request: dict[str, Any]
              ) -> None:
    digest = hashlib.sha256(json.dumps(request, sort_keys=True,
                                       separators=(",", ":")).encode()).digest()
    if conn.execute(RECIPE_CLAIM, (scope, key, digest)).fetchone() is None:
        raise RuntimeError("fresh key taken")  # a real recipe would look up the stored answer
    with conn.transaction():
        conn.execute(INSERT_LEDGER, (key, scope, request["amount"], request["currency"]))
        conn.execute(RECIPE_COMPLETE, (201, Jsonb(answer(key, request)), scope, key))


def do_ours(conn: psycopg.Connection[Any], key: str, scope: str, request: dict[str, Any]
            ) -> None:
    with idem.operation(conn, scope, key, request) as op:
        if op.replay is not None:
            raise RuntimeError("fresh key replayed")
        op.conn.execute(INSERT_LEDGER, (key, scope, request["amount"], request["currency"]))
        op.complete(201, answer(key, request))


DO = {"none": do_none, "recipe": do_recipe, "ours": do_ours}


def load_baseline(directory: str) -> None:
    """Import DIR/pg_idempotency as ``pg_idempotency_baseline`` (its imports are relative) and
    add the variant ``base``, the operation() pattern through it."""
    package = Path(directory).resolve() / "pg_idempotency"
    spec = importlib.util.spec_from_file_location(
        "pg_idempotency_baseline", package / "__init__.py",
        submodule_search_locations=[str(package)])
    if spec is None or spec.loader is None:
        raise SystemExit(f"--baseline: no package in {package}")
    base = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = base
    spec.loader.exec_module(base)

    def do_base(conn: psycopg.Connection[Any], key: str, scope: str, request: dict[str, Any]
                ) -> None:
        with base.operation(conn, scope, key, request) as op:
            if op.replay is not None:
                raise RuntimeError("fresh key replayed")
            op.conn.execute(INSERT_LEDGER, (key, scope, request["amount"],
                                            request["currency"]))
            op.complete(201, answer(key, request))

    DO["base"] = do_base


def measure(server: Any, dsn: str, admin: psycopg.Connection[Any], variant: str, tag: str,
            args: argparse.Namespace) -> dict[str, float]:
    admin.execute(TRUNCATE_SQL)
    do = DO[variant]
    counts = [0] * args.threads
    stop = threading.Event()
    errors: list[BaseException] = []
    conns = [psycopg.connect(dsn, autocommit=True) for _ in range(args.threads)]

    def worker(i: int) -> None:
        conn, n = conns[i], 0
        try:
            while not stop.is_set():
                n += 1
                scope, request = payment(i, n)
                do(conn, f"{tag}-{i}-{n}", scope, request)
                counts[i] = n
        except BaseException as exc:  # noqa: BLE001 - reported by the driver
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.threads)]
    for t in threads:
        t.start()
    try:
        time.sleep(args.warmup)
        n0, app0, pg0, t0 = sum(counts), time.process_time(), common.server_cpu(server), \
            time.perf_counter()
        time.sleep(args.seconds)
        n1, app1, pg1, t1 = sum(counts), time.process_time(), common.server_cpu(server), \
            time.perf_counter()
    finally:
        stop.set()
        for t in threads:
            t.join()
        for c in conns:
            c.close()
    if errors:
        raise SystemExit(f"{variant}: {errors[0]!r}")
    n = max(n1 - n0, 1)
    rows, distinct = admin.execute(CHECK_SQL).fetchone()
    return {
        "rps": n / (t1 - t0),
        "pg_cpu_ms": common.cpu_delta(pg0, pg1) * 1000 / common.clock_ticks() / n,
        "app_cpu_ms": (app1 - app0) * 1000 / n,
        "payments": sum(counts), "ledger_rows": rows, "ledger_distinct": distinct,
    }


FIELDS = ("pg_cpu_ms", "app_cpu_ms", "rps")


def summarise(rounds: list[dict[str, dict[str, float]]]) -> dict[str, Any]:
    bases = [b for b in ("recipe", "none", "base") if b in rounds[0]]
    return {"rounds": rounds, **common.ratio_summary(rounds, "ours", bases, FIELDS)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--server", default="pg15", help="pgharness flavour (pg15, pg18)")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--baseline", metavar="DIR",
                        help="also run the pattern with the package in DIR/pg_idempotency")
    parser.add_argument("--extra-sql", metavar="FILE",
                        help="run this SQL file after the migrations, as the owner (an "
                        "experiment: a function replaced, say)")
    args = parser.parse_args()
    common.check_writable(parser, json=args.json)
    variants = VARIANTS
    if args.baseline:
        load_baseline(args.baseline)
        variants = (*VARIANTS, "base")
    started = time.monotonic()
    with pgharness.PgServer(pgharness.flavour_bindir(args.server), extra_conf=DURABLE,
                            name="bench-operation") as server:
        server.run_psql(server.dsn(), "CREATE DATABASE bench")
        dsn = server.dsn("bench")
        common.install_engine(server, dsn)
        server.run_psql(dsn, SCHEMA_SQL, args=PSQL_FILE)
        if args.extra_sql:
            server.run_psql(dsn, Path(args.extra_sql), args=PSQL_ONE_TX)
        version = common.version(server)
        print(f"{version}, default durability; {args.threads} threads, fresh keys; "
              f"{args.rounds} round(s) x {args.seconds:g}s after {args.warmup:g}s warm-up; "
              f"package {idem.__file__}"
              + (f"; after the migrations {args.extra_sql}" if args.extra_sql else ""),
              flush=True)
        rounds = []
        bad = 0
        with psycopg.connect(dsn, autocommit=True) as admin:
            for r in range(args.rounds):
                per = {}
                for variant in variants:
                    res = measure(server, dsn, admin, variant, f"{variant[0]}{r}", args)
                    per[variant] = res
                    ok = res["ledger_rows"] == res["ledger_distinct"] == res["payments"]
                    bad += not ok
                    print(f"  round {r + 1} {variant:6s} {res['rps']:7.0f} payments/s  "
                          f"server CPU {res['pg_cpu_ms']:.3f} ms  app CPU "
                          f"{res['app_cpu_ms']:.3f} ms /payment  ledger "
                          f"{'ok' if ok else 'WRONG'} ({res['ledger_rows']} rows)", flush=True)
                rounds.append(per)
    result = summarise(rounds)
    labels = {"pg_cpu_ms": "server CPU ms/payment", "app_cpu_ms": "app CPU ms/payment",
              "rps": "payments/s"}
    print(f"\nmedians of {args.rounds} rounds, and ours over recipe and over none per round "
          f"(median); took {time.monotonic() - started:.0f}s\n")
    print("| figure | none | recipe | ours | ours/recipe per round (median) "
          "| ours/none per round (median) |")
    print("|---|---:|---:|---:|---|---|")
    for field, label in labels.items():
        per, fmt = result["per_request"][field], ".3f" if field != "rps" else ".0f"
        cells = [common.rounds_cell(result["ratios"][f"{field}_over_{base}"])
                 for base in ("recipe", "none")]
        print(f"| {label} | {per['none']:{fmt}} | {per['recipe']:{fmt}} | {per['ours']:{fmt}} "
              f"| {cells[0]} | {cells[1]} |")
    if args.baseline:
        print(f"\nours / base (the package in {args.baseline}) per round (median):\n")
        for field, label in labels.items():
            fmt = ".3f" if field != "rps" else ".0f"
            print(f"- {label}: base {result['per_request'][field]['base']:{fmt}}; "
                  + common.rounds_cell(result["ratios"][f"{field}_over_base"]))
    if args.json:
        common.write_json(args.json, {"server": version, "threads": args.threads,
                                      "seconds": args.seconds, "warmup": args.warmup, **result})
    if bad:
        print(f"LEDGER WRONG in {bad} measurement(s)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
