#!/usr/bin/env python3
"""CPU instructions per payment in a real backend: the README's ``operation()`` pattern, the
recipe and no idempotency, as bench/operation.py runs them, counted by valgrind's callgrind.

Timing CPU on this shared two-core machine moves by ±10% between rounds of the same code;
instructions do not. The server is started under ``valgrind --tool=callgrind
--trace-children=yes`` (a backend is a fork of the postmaster, so each gets a count of its
own), and each variant runs on two connections of its own, one after the other: W payments on
the first, W + N on the second. Both pay the same connection start-up and the same first W
payments (psycopg prepares the recipe's statements after 5 executions, so they are prepared in
both by then), so the difference of their backends' counts over N is what one payment costs
its backend in the steady state: the real protocol (claim as an extended-protocol statement,
complete + COMMIT as one simple Query, the recipe's prepared statements), the real package,
the real engine. What it leaves out: the WAL writer, checkpointer and other server processes,
and the kernel (system time, WAL fsyncs), which bench/operation.py's CPU figures include; so
the ratio here is the backends' work alone, larger than the server CPU ratio there.

  none      BEGIN; the ledger INSERT; COMMIT
  recipe    INSERT ... ON CONFLICT DO NOTHING RETURNING; BEGIN; the ledger INSERT; UPDATE; COMMIT
  ours      ``with idem.operation(conn, scope, key, request) as op:`` + the INSERT +
            ``op.complete(201, answer)``
  prepared  ours after ``pg_idempotency.allow_prepared_statements()`` (the opt-in for processes
            behind no transaction-mode pooler)
  base      ours with the package in --baseline DIR (an earlier commit's python/)

Deterministic to a few hundred instructions per payment (two runs of the same tree agree to
0.01%). Needs valgrind (Debian's package); about 15 s per server.

    .venv/bin/python bench/instructions.py [--servers pg15,pg18] [--payments 100]
                                           [--baseline DIR] [--json PATH]
                                           [--variants ours,recipe] [--extra-sql FILE]
                                           [--keep DIR]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common
import operation as B  # bench/operation.py: the variants (it imports this tree's package)
import psycopg
from common import PSQL_FILE

import pg_idempotency as idem
import pgharness
from pg_idempotency import core

WARMUP = 10


def _total(path: Path) -> int:
    """The instructions a callgrind output file counted (its ``totals:`` or ``summary:``)."""
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith(("totals:", "summary:")):
            return int(line.split()[1])
    raise SystemExit(f"no totals in {path}")


def _run(conn: psycopg.Connection[Any], variant: str, tag: str, count: int) -> None:
    do = B.DO["ours" if variant == "prepared" else variant]
    prepare = core._PREPARE
    if variant == "prepared":
        idem.allow_prepared_statements()
    try:
        for i in range(count):
            scope, request = B.payment(1, i)
            do(conn, f"{tag}-{i}", scope, request)
    finally:
        core._PREPARE = prepare


def measure(flavour: str, variants: list[str], payments: int,
            extra_sql: Path | None = None, keep: Path | None = None) -> dict[str, Any]:
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("bench/instructions.py needs valgrind (apt-get install valgrind)")
    with tempfile.TemporaryDirectory(prefix="instructions-") as tmp, \
            pgharness.PgServer(pgharness.flavour_bindir(flavour), name="instructions") as server:
        server.run_psql(server.dsn(), "CREATE DATABASE bench")
        dsn = server.dsn("bench")
        common.install_engine(server, dsn)
        server.run_psql(dsn, B.SCHEMA_SQL, args=PSQL_FILE)
        if extra_sql is not None:
            server.run_psql(dsn, extra_sql, args=PSQL_FILE)
        version = common.version(server)
        subprocess.run([str(server.bindir / "pg_ctl"), "stop", "-D", str(server.datadir),
                        "-m", "fast", "-w"], check=True, capture_output=True)
        out = Path(tmp)
        # the harness's settings (postgresql.conf), the port and sockets it chose
        with open(out / "server.log", "w") as log:
            proc = subprocess.Popen(
                [valgrind, "--tool=callgrind", "--trace-children=yes",
                 f"--callgrind-out-file={out}/callgrind.%p", str(server.bindir / "postgres"),
                 "-D", str(server.datadir), "-p", str(server.port), "-h", "127.0.0.1",
                 "-k", str(server.socket_dir), "-c", "autovacuum=off"],
                stdout=subprocess.DEVNULL, stderr=log)
        try:
            for _ in range(300):
                try:
                    psycopg.connect(dsn, connect_timeout=5).close()
                    break
                except psycopg.OperationalError:
                    if proc.poll() is not None:
                        raise SystemExit((out / "server.log").read_text()[-3000:]) from None
                    time.sleep(1)
            pids: dict[tuple[str, int], int] = {}
            for variant in variants:
                for count in (WARMUP, WARMUP + payments):
                    with psycopg.connect(dsn, autocommit=True) as conn:
                        pids[(variant, count)] = conn.info.backend_pid
                        _run(conn, variant, f"{variant}{count}", count)
                    with psycopg.connect(dsn, autocommit=True) as admin:
                        rows, distinct = admin.execute(B.CHECK_SQL).fetchone()
                        if rows != distinct:
                            raise SystemExit(f"{variant}: the ledger has duplicates")
        finally:
            proc.terminate()  # smart shutdown: every backend has ended, its file is written
            proc.wait(600)
        per = {v: (_total(out / f"callgrind.{pids[(v, WARMUP + payments)]}")
                   - _total(out / f"callgrind.{pids[(v, WARMUP)]}")) / payments
               for v in variants}
        if keep is not None:  # the longer run's file: for callgrind_annotate --inclusive=yes
            keep.mkdir(parents=True, exist_ok=True)
            for v in variants:
                shutil.copy(out / f"callgrind.{pids[(v, WARMUP + payments)]}",
                            keep / f"{flavour}-{v}.callgrind")
    return {"server": version, "payments": payments, "per_payment": per}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default="pg15,pg18")
    parser.add_argument("--payments", type=int, default=100)
    parser.add_argument("--baseline", metavar="DIR",
                        help="also count the pattern with the package in DIR/pg_idempotency")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--extra-sql", metavar="FILE", type=Path,
                        help="run this SQL file after the migrations (an experiment: a "
                             "function replaced, say), as the owner")
    parser.add_argument("--variants", help="a subset, e.g. ours,recipe")
    parser.add_argument("--keep", metavar="DIR", type=Path,
                        help="keep each variant's callgrind file of its longer run here "
                             "(SERVER-VARIANT.callgrind), to read with callgrind_annotate")
    args = parser.parse_args()
    common.check_writable(parser, json=args.json)
    variants = ["none", "recipe", "ours", "prepared"]
    if args.variants:
        variants = args.variants.split(",")
    if args.baseline:
        B.load_baseline(args.baseline)
        variants.append("base")
    results = []
    print("| server | " + " | ".join(variants) + " | ours/recipe | ours/none |"
          + (" ours/base |" if args.baseline else ""))
    print("|---|" + "---:|" * (len(variants) + 2 + bool(args.baseline)))
    for flavour in args.servers.split(","):
        res = measure(flavour, variants, args.payments, args.extra_sql, args.keep)
        per = res["per_payment"]
        cells = [f"{per[v]:,.0f}" for v in variants]
        ratios = [per["ours"] / per[b] if "ours" in per and b in per else float("nan")
                  for b in ("recipe", "none", *(["base"] if args.baseline else []))]
        print(f"| {res['server']} | " + " | ".join(cells) + " | "
              + " | ".join(f"{r:.2f}" for r in ratios) + " |", flush=True)
        results.append(res)
    print(f"\n(instructions per payment in its backend: the difference between {WARMUP} and "
          f"{WARMUP + args.payments} payments on two connections, over {args.payments})")
    if args.json:
        common.write_json(args.json, {"results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
