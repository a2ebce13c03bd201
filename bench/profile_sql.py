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

Since 0.9.0 claim takes no advisory lock: its ``INSERT ... ON CONFLICT DO NOTHING`` into
``key_directory`` is the arbiter (one owner per key), then it inserts the key row; complete
(``complete_bytes`` for the middleware) checks its arguments and calls the generated route
``_complete_row``, whose guess runs the fenced UPDATE on the partition of the completion's own
time: two PL/pgSQL levels and no directory read since 0.11.0 (three levels, through
``_finish``, and a directory read before). Since 0.11.0 claim and complete_bytes test their
arguments in one inlined expression and check them one by one only when it fails; claim's new
key goes from the directory insert straight to its row, without the retry loop; the route locks
the parent with ``LOCK TABLE ONLY`` instead of a query.

``--ablate`` measures what each part of claim costs instead: copies of ``idempotency.claim``
(from ``pg_get_functiondef``, so always the installed one) with one part taken out, all called
in turn in each pgbench transaction with keys of their own, so they share the machine's noise;
``track_functions`` gives each copy's time per call, and the difference to the unchanged copy
is that part's cost. The copies are: ``same`` (unchanged), ``no_secdef`` (not SECURITY
DEFINER), ``no_plan_mode`` (no ``SET plan_cache_mode``), ``no_path`` (no ``SET search_path``),
``no_checks`` (no argument and isolation checks: since 0.11.0 the fast path's one test),
``const_token`` (``coalesce(previous, 0) + 1`` instead of ``_new_token``: no gen_random_uuid,
clock or bit casts), ``no_keys_insert`` (the directory insert alone: the key row's insert costs
the difference). The same is done for
complete_bytes: ``same``, ``no_secdef`` and ``no_checks`` (all argument checks). (No copy of
complete_bytes without ``SET search_path`` or with ``SET plan_cache_mode``: the copies share
the route ``_complete_row``, whose cached plans are made again whenever a caller's
search_path differs from the last one's, so such a copy measured 200 µs, not its own cost.)

``pg_stat_statements`` times a statement's execution, not its executor start-up and shut-down,
nor the PL/pgSQL around it: a function's own time minus its statements' is that rest. This is
a profile, not a benchmark: absolute numbers move with the machine's load, proportions less.

``--callgrind N`` counts CPU instructions instead of timing: N claim + complete_bytes, each in
its own transaction, in a single-user backend (``postgres --single``) under valgrind's
callgrind, against the same run with no payment; the difference over N is what the server
executes per payment. Deterministic to a few hundred instructions, so it resolves what no
timing on a shared machine does (two trees compared: run it in each). The top-level statements
are simple Query messages with literals, and the token comes from a table the claim fills: both
add parse, analysis and planning that the package's statements do not have, the same for every
text. Needs valgrind; callgrind_annotate reads the kept output file. ``--callgrind-texts``
picks the statement texts, the functions' work being the same: ``package`` (the default) the
package's own sends (positional, untyped, each call in the select list), ``named`` the named and
cast texts with claim_result's 13 columns and complete's epoch (the prepared opt-in's, the
fallback's, docs/other-languages.md's), ``epoch`` the package's claim with the named complete
(its own sends under a DateStyle other than ISO), ``from`` positional calls in FROM with
``SELECT *``.

    .venv/bin/python bench/profile_sql.py [--workload middleware] [--server pg15]
                                          [--seconds 10] [--clients 2] [--ablate]
                                          [--callgrind 300 [--callgrind-texts named]]
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import common
import psycopg
from common import BENCH, PSQL_FILE, ROOT

import pgharness

CONF = {"shared_preload_libraries": "pg_stat_statements", "pg_stat_statements.track": "all",
        "track_functions": "all", "fsync": "off", "synchronous_commit": "off",
        "full_page_writes": "off"}

MIDDLEWARE = r"""-- what the ASGI middleware sends (bench/profile_sql.py)
\set k random(1, 9000000000000000000)
SELECT lease_token AS tok FROM idempotency.claim('acct_1', 'k' || :k, NULL,
    fingerprint => sha256('POST /payments {"amount":50}'::bytea)) \gset
SELECT idempotency.complete_bytes('acct_1', 'k' || :k, :tok, 201, '\x7b7d'::bytea,
    'application/json', '{}');
"""

STATEMENTS = """
SELECT calls, round((total_exec_time / calls * 1000)::numeric, 1) AS us, toplevel,
       left(regexp_replace(query, '\\s+', ' ', 'g'), 110) AS query
FROM pg_stat_statements WHERE calls >= 100 AND query NOT LIKE '%pg_stat%'
ORDER BY total_exec_time DESC LIMIT 25
"""
# (name, [(pattern, replacement)]): copies of claim with one part taken out
CLAIM_ABLATIONS = [
    ("same", []),
    ("no_secdef", [(r"\n\s*SECURITY DEFINER[^\n]*", "")]),
    ("no_plan_mode", [(r"\n\s*SET plan_cache_mode[^\n]*", "")]),
    ("no_path", [(r"\n\s*SET search_path[^\n]*", "")]),
    # the fast path's one test and the branch behind it (whose body never runs here)
    ("no_checks", [(r"IF NOT coalesce\(claim\.reference_time.*?\n    END IF;\n", "")]),
    ("const_token", [(r"idempotency\._new_token\(v_previous\)", "coalesce(v_previous, 0) + 1")]),
    ("no_keys_insert", [(r"INSERT INTO idempotency\.keys AS k.*?v_result\.created_at;",
                         "v_result.outcome := 'claimed';")]),
]
COMPLETE_ABLATIONS = [
    ("same", []),
    ("no_secdef", [(r"\n\s*SECURITY DEFINER[^\n]*", "")]),
    ("no_checks", [(r"IF NOT coalesce\(complete_bytes\.reference_time.*?\n    END IF;\n",
                    "")]),
]


def ablation_copy(definition: str, fn: str, name: str, edits: list[tuple[str, str]]) -> str:
    """The function's CREATE statement, renamed idempotency.{fn}_ab_{name}, edited."""
    new = f"{fn}_ab_{name}"
    out = definition
    for pattern, repl in edits:
        out, n = re.subn(pattern, repl, out, count=1, flags=re.S)
        if n != 1:
            raise SystemExit(f"ablation {name}: {pattern!r} not found in {fn}: stale ablation")
    out = out.replace(f"FUNCTION idempotency.{fn}(", f"FUNCTION idempotency.{new}(", 1)
    return re.sub(rf"\b{fn}\.", f"{new}.", out)  # the parameters, qualified by the name


def ablation_script(db: str, path: Path) -> list[Path]:
    """Create the copies and write the pgbench script that calls each in turn."""
    with psycopg.connect(db, autocommit=True) as conn:
        get = ("SELECT pg_get_functiondef(p.oid) FROM pg_proc p JOIN pg_namespace n "
               "ON n.oid = p.pronamespace WHERE n.nspname = 'idempotency' AND p.proname = %s")
        claim = conn.execute(get, ("claim",)).fetchone()[0]
        complete = conn.execute(get, ("complete_bytes",)).fetchone()[0]
        for name, edits in CLAIM_ABLATIONS:
            conn.execute(ablation_copy(claim, "claim", name, edits))
        for name, edits in COMPLETE_ABLATIONS:
            conn.execute(ablation_copy(complete, "complete_bytes", name, edits))
    lines = ["-- claim ablation (bench/profile_sql.py --ablate)",
             "\\set k random(1, 9000000000000000000)"]
    for name, _ in CLAIM_ABLATIONS:
        lines.append(f"SELECT lease_token AS tok_{name} FROM idempotency.claim_ab_{name}("
                     f"'acct_1', 'k' || :k || '{name}', NULL, fingerprint => "
                     "sha256('POST /payments {\"amount\":50}'::bytea)) \\gset")
    # each complete copy completes one of the keys just claimed (not no_keys_insert's: it has
    # no key row)
    completes = [name for name, _ in COMPLETE_ABLATIONS]
    for name, claimed in zip(completes, [n for n, _ in CLAIM_ABLATIONS], strict=False):
        lines.append(f"SELECT idempotency.complete_bytes_ab_{name}('acct_1', 'k' || :k || "
                     f"'{claimed}', :tok_{claimed}, 201, '\\x7b7d'::bytea, "
                     "'application/json', '{}');")
    # one script per rotation of the claims (pgbench picks one per transaction), so that no
    # copy always runs first (the first call of a transaction is the slowest)
    head, claims, tail = lines[:2], lines[2:2 + len(CLAIM_ABLATIONS)], lines[2 + len(
        CLAIM_ABLATIONS):]
    paths = []
    for i in range(len(claims)):
        rotated = path.with_name(f"{path.stem}{i}.pgbench")
        rotated.write_text("\n".join(head + claims[i:] + claims[:i] + tail[i % len(tail):]
                                     + tail[:i % len(tail)]) + "\n")
        paths.append(rotated)
    return paths


# --callgrind: one payment with literals (a single-user backend has no parameters); {k} the key.
# --callgrind-texts picks the statement texts:
#   named    the named, cast texts (queries.CLAIM_BINARY, COMPLETE_BYTES: claim_result's 13
#            columns, complete's time as epoch text): what a prepared statement (the opt-in),
#            the cursor's fallback and other drivers following docs/other-languages.md send
#   package  the package's own sends (queries.CLAIM_SHORT, COMPLETE_BYTES_SHORT under DateStyle
#            ISO): positional, untyped literals, each call in the select list
#   epoch    the package's claim with the named complete (its own sends under another DateStyle)
#   from     positional and untyped, each call in FROM with SELECT * (no epoch conversion)
NAMED_CLAIM = (
    "INSERT INTO bench_token SELECT '{k}', c.lease_token FROM (SELECT outcome, lease_token, "
    "lease_expires_at, recovery_point, attempts, response_status, response_headers, "
    "response_body, response_body_bytes, response_content_type, retry_after, created_at, "
    "completed_at FROM idempotency.claim(scope => 'acct_1'::text, key => '{k}'::text, "
    "request => NULL::jsonb, lease => '30 seconds'::interval, "
    "fingerprint => sha256('{k}'::bytea)::bytea, strict => false::boolean, "
    "reference_time => NULL::timestamptz)) AS c")
NAMED_COMPLETE = (
    "SELECT extract(epoch FROM r)::text AS completed_at FROM idempotency.complete_bytes("
    "scope => 'acct_1'::text, key => '{k}'::text, "
    "lease_token => (SELECT t.token FROM bench_token AS t WHERE t.key = '{k}')::bigint, "
    "status => 201::integer, body => '\\x7b226964223a227061795f31227d'::bytea, "
    "content_type => 'application/json'::text, headers => '{{}}'::jsonb, "
    "reference_time => NULL::timestamptz) AS r")
_ARGS = ("'acct_1', '{k}', (SELECT t.token FROM bench_token AS t WHERE t.key = '{k}'), 201, "
         "'\\x7b226964223a227061795f31227d', 'application/json', '{{}}', NULL")
PACKAGE_CLAIM = (
    "INSERT INTO bench_token SELECT '{k}', (c.r).lease_token FROM (SELECT idempotency.claim("
    "'acct_1', '{k}', NULL, '30 seconds', sha256('{k}'::bytea), false, NULL) AS r) AS c")
PACKAGE_COMPLETE = f"SELECT idempotency.complete_bytes({_ARGS}) AS completed_at"
FROM_CLAIM = (
    "INSERT INTO bench_token SELECT '{k}', c.lease_token FROM (SELECT * FROM idempotency.claim("
    "'acct_1', '{k}', NULL, '30 seconds', sha256('{k}'::bytea), false, NULL)) AS c")
FROM_COMPLETE = f"SELECT * FROM idempotency.complete_bytes({_ARGS})"
CALLGRIND_TEXTS = {"named": (NAMED_CLAIM, NAMED_COMPLETE),
                   "package": (PACKAGE_CLAIM, PACKAGE_COMPLETE),
                   "epoch": (PACKAGE_CLAIM, NAMED_COMPLETE),
                   "from": (FROM_CLAIM, FROM_COMPLETE)}


def callgrind(server: pgharness.PgServer, tmp: Path, payments: int,
              texts: str = "package") -> int:
    """Instructions per payment: a single-user backend under callgrind, N payments against 0."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("--callgrind needs valgrind (apt-get install valgrind)")
    subprocess.run([str(server.bindir / "pg_ctl"), "stop", "-D", str(server.datadir), "-m",
                    "fast", "-w"], check=True, capture_output=True)
    counts = {}
    for n in (0, payments):
        # -j: a statement ends at a semicolon followed by an empty line
        text = "".join(f"{stmt.format(k=f'k{i}')};\n\n" for i in range(n)
                       for stmt in CALLGRIND_TEXTS[texts])
        out = tmp / f"callgrind.{n}.out"
        run = subprocess.run(
            [valgrind, "--tool=callgrind", f"--callgrind-out-file={out}",
             str(server.bindir / "postgres"), "--single", "-D", str(server.datadir),
             "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
             "-c", "shared_preload_libraries=", "-j", "bench"],
            input="SELECT 1;\n\n" + text, capture_output=True, text=True, check=False)
        errors = [line for line in run.stdout.splitlines() + run.stderr.splitlines()
                  if "ERROR:" in line]
        match = re.search(r"Collected : (\d+)", run.stderr)
        if run.returncode != 0 or errors or not match:
            raise SystemExit(f"callgrind run failed: {errors[:3] or run.stderr[-2000:]}")
        counts[n] = int(match.group(1))
        if n:
            kept = ROOT / "build" / "profile_sql.callgrind.out"
            shutil.copy(out, kept)
            print(f"callgrind output of the {n} payments: {kept} (callgrind_annotate "
                  "--inclusive=yes reads it)")
    return (counts[payments] - counts[0]) // payments


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
    parser.add_argument("--durable", action="store_true",
                        help="PostgreSQL's default durability (fsync, synchronous_commit, "
                             "full_page_writes on), as bench/http.py runs")
    parser.add_argument("--protocol", default="prepared", choices=["prepared", "simple"],
                        help="pgbench -M: simple parses and plans every statement, as the "
                             "package does (prepare=False)")
    parser.add_argument("--callgrind", type=int, metavar="N",
                        help="count the instructions of N claim + complete_bytes in a "
                             "single-user backend under valgrind instead of timing")
    parser.add_argument("--callgrind-texts", default="package", choices=list(CALLGRIND_TEXTS),
                        help="with --callgrind: which statement texts (the comment above "
                             "CALLGRIND_TEXTS): the package's own sends by default")
    parser.add_argument("--ablate", action="store_true",
                        help="time copies of claim and complete_bytes with one part removed")
    args = parser.parse_args()
    conf = dict(CONF)
    if args.durable:
        for name in ("fsync", "synchronous_commit", "full_page_writes"):
            conf[name] = "on"
    with tempfile.TemporaryDirectory() as tmp, pgharness.PgServer(
            pgharness.flavour_bindir(args.server), extra_conf=conf, name="profile") as server:
        script = Path(tmp) / "workload.pgbench"
        if args.workload == "middleware":
            script.write_text(MIDDLEWARE)
        else:
            script.write_text((BENCH / f"{args.workload}.pgbench").read_text())
        server.run_psql(server.dsn(), "CREATE DATABASE bench")
        db = server.dsn("bench")
        common.install_engine(server, db)
        server.run_psql(db, "CREATE EXTENSION pg_stat_statements; CREATE TABLE bench_bare "
                        "(LIKE idempotency.keys INCLUDING DEFAULTS, PRIMARY KEY (scope, key))")
        server.run_psql(db, BENCH / "floor.sql", args=PSQL_FILE)
        if args.callgrind:
            server.run_psql(db, "CREATE TABLE bench_token (key text PRIMARY KEY, token bigint)")
            per = callgrind(server, Path(tmp), args.callgrind, args.callgrind_texts)
            print(f"{server.version.split(',')[0]}: {per:,} instructions per claim + "
                  f"complete_bytes ({args.callgrind} payments, callgrind, single-user backend,"
                  f" {args.callgrind_texts} statement texts)")
            return 0

        def pgbench(seconds: int) -> float:
            return common.pgbench(server, db, scripts, seconds, args.clients,
                                  mode=args.protocol)

        scripts = ablation_script(db, script) if args.ablate else [script]
        pgbench(2)  # warm up: compile the functions, fill the caches
        with psycopg.connect(db, autocommit=True) as conn:
            conn.execute("SELECT pg_stat_statements_reset()")
            conn.execute("SELECT pg_stat_reset()")
        tps = pgbench(args.seconds)
        with psycopg.connect(db, autocommit=True) as conn:
            what = "ablation" if args.ablate else f"workload {args.workload}"
            print(f"{server.version.split(',')[0]}, {what}, {args.clients} "
                  f"clients, {args.seconds} s, -M {args.protocol}, "
                  f"{'durable' if args.durable else 'fast'}: {tps:.0f} tps")
            print("\nstatements (µs per call; toplevel f = inside a function):")
            for calls, us, top, query in conn.execute(STATEMENTS):
                print(f"  {us:>7} µs  {calls:>7} calls  {'t' if top else 'f'}  {query}")
            print("\nfunctions (µs per call: total, own):")
            for name, calls, total, own in conn.execute(FUNCTIONS):
                print(f"  {name:<24s} {calls:>7} calls  {total:>7} µs  {own:>7} µs")
            if args.ablate:
                times = dict(conn.execute(
                    "SELECT funcname, total_time / calls * 1000 FROM pg_stat_user_functions "
                    "WHERE funcname LIKE '%\\_ab\\_%' AND calls > 0").fetchall())
                print("\nablation: what the part costs (the unchanged copy minus this one, µs)")
                for fn in ("claim", "complete_bytes"):
                    same = times.get(f"{fn}_ab_same")
                    for name, us in sorted(times.items()):
                        if name.startswith(f"{fn}_ab_") and same is not None:
                            print(f"  {name:<28s} {us:7.1f} µs  part {same - us:6.1f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
