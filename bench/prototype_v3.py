#!/usr/bin/env python3
"""Engine v3 PROTOTYPE benchmark: bare recipe vs engine vs prototype (bench/prototype_v3.sql).

NOT the engine: the prototype lives in bench/ and in a schema ``proto`` of a throwaway server,
next to the current engine (migrations/*.sql). Three pgbench workloads, interleaved round by
round so machine noise hits them alike:

  bare    INSERT ... ON CONFLICT DO NOTHING + UPDATE on a plain table (bench/bare.pgbench)
  engine  idempotency.claim(fingerprint =>) + idempotency.complete_bytes (what the middleware
          sends)
  proto   proto.claim + proto.complete (one PL/pgSQL level each, inline checks and token,
          complete given the created_at claim returned: no directory read)

Prints per round the tps and the ratios bare/proto and bare/engine (= server cost relative to
the recipe), their medians, and pg_stat_statements (track = top) mean execution time per
statement for each workload. Before the rounds it checks the prototype's replay, mismatch and
fencing answers on real rows.

    /work/main/.venv/bin/python bench/prototype_v3.py [--servers pg15,pg18]
        [--modes durable,fast] [--clients 4] [--seconds 5] [--rounds 3] [--prefill 20000]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import psycopg  # noqa: E402
import run  # noqa: E402  (bench/run.py)

import pgharness  # noqa: E402

BENCH = ROOT / "bench"
STATS = {"shared_preload_libraries": "pg_stat_statements", "pg_stat_statements.track": "top"}
FAST = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}
# the harness's own defaults are fast; "durable" sets PostgreSQL's defaults back explicitly
DURABLE = {"fsync": "on", "synchronous_commit": "on", "full_page_writes": "on"}

# run.py's setup (partitions, prefill in the engine's tables and the bare one), plus
# pg_stat_statements for the time per call.
SETUP_SQL = "CREATE EXTENSION pg_stat_statements;\n" + run.SETUP_SQL

COPY_SQL = """
INSERT INTO proto.keys SELECT * FROM idempotency.keys;
INSERT INTO proto.key_directory SELECT * FROM idempotency.key_directory;
VACUUM ANALYZE;
"""

ENGINE = r"""-- engine, as the middleware calls it
\set k random(1, 1000000000000)
SELECT lease_token AS tok FROM idempotency.claim('acct_1', 'k' || :k, NULL,
    fingerprint => sha256('POST /payments {"amount":50}'::bytea)) \gset
SELECT idempotency.complete_bytes('acct_1', 'k' || :k, :tok, 201, '\x7b7d'::bytea,
    'application/json', '{}');
"""

VARIANTS = {  # workload: (claim, complete) of the prototype's copies, one idea taken out
    "proto_parent_complete": ("claim", "complete_parent"),
    "proto_parent_claim": ("claim_parent", "complete"),
    "proto_secdef_off": ("claim_nosec", "complete_nosec"),
    "proto_const_token": ("claim_consttoken", "complete"),
}

PROTO = r"""-- prototype: complete gets the created_at claim returned
\set k random(1, 1000000000000)
SELECT lease_token AS tok, created_at AS ca FROM proto.claim('acct_1', 'k' || :k,
    sha256('POST /payments {"amount":50}'::bytea)) \gset
SELECT proto.complete('acct_1', 'k' || :k, :tok, :ca, 201, '\x7b7d'::bytea,
    'application/json', '{}');
"""


def pgbench(server: pgharness.PgServer, script: Path, seconds: int, clients: int) -> float:
    out = subprocess.run(
        [str(server.bindir / "pgbench"), "-n", "-M", "prepared", "-c", str(clients),
         "-j", str(min(clients, 2)), "-T", str(seconds), "-f", str(script),
         server.dsn("bench")],
        capture_output=True, text=True, check=False)
    match = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", out.stdout)
    if out.returncode != 0 or not match:
        raise SystemExit(f"pgbench failed:\n{out.stdout}\n{out.stderr}")
    return float(match.group(1))


ROUTED = """
CREATE OR REPLACE FUNCTION proto.complete(
    p_scope text, p_key text, p_token bigint, p_created_at timestamptz, p_status integer,
    p_body bytea, p_content_type text, p_headers jsonb DEFAULT '{}')
RETURNS void LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NOT coalesce(p_status BETWEEN 100 AND 599 AND length(p_content_type) <= 255, false) THEN
        RAISE EXCEPTION 'proto.complete: invalid argument' USING ERRCODE = '22023';
    END IF;
    %s
    IF NOT FOUND THEN
        RAISE EXCEPTION 'proto.complete: lease lost or key gone' USING ERRCODE = '55000';
    END IF;
END;
$$;
COMMENT ON FUNCTION proto.complete(text, text, bigint, timestamptz, integer, bytea, text, jsonb)
IS 'PROTOTYPE (bench/prototype_v3.py): fenced complete, one static UPDATE per partition.';
"""
UPDATE = """UPDATE {table} AS k
    SET state = 'completed', response_status = p_status, response_headers = p_headers,
        response_body_bytes = p_body, response_content_type = p_content_type,
        completed_at = clock_timestamp(), lease_expires_at = NULL
    WHERE k.scope = p_scope AND k.key = p_key AND k.created_at = p_created_at
      AND k.lease_token = p_token AND k.state = 'in_progress';"""


def proto_partitions(db: str) -> None:
    """proto.keys gets the partition bounds of idempotency.keys, and proto.complete its routes:
    an IF on created_at per partition, each branch a static UPDATE of that partition."""
    branches = []
    with psycopg.connect(db, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i "
            "JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = 'idempotency.keys'::regclass ORDER BY 2").fetchall()
        for name, bound in rows:
            conn.execute(f"CREATE TABLE proto.{name} PARTITION OF proto.keys {bound}")
            m = re.match(r"FOR VALUES FROM \('([^']*)'\) TO \('([^']*)'\)", bound)
            if m:
                branches.append(f"p_created_at >= '{m[1]}' AND p_created_at < '{m[2]}' THEN\n"
                                + UPDATE.format(table=f"proto.{name}"))
        body = ("IF " + "\n    ELSIF ".join(branches) + "\n    ELSE\n"
                + UPDATE.format(table="proto.keys") + "\n    END IF;")
        conn.execute(ROUTED % body)
        get = "SELECT pg_get_functiondef(%s::regprocedure)"
        claim = conn.execute(get, ("proto.claim_parent(text,text,bytea,interval)",)
                             ).fetchone()[0]
        complete = conn.execute(get, ("proto.complete(text,text,bigint,timestamptz,integer,"
                                      "bytea,text,jsonb)",)).fetchone()[0]
        insert = re.search(r"INSERT INTO proto\.keys AS k.*?v_result\.lease_token, "
                           r"v_result\.created_at;", claim, re.S)[0]
        chain = []
        for name, bound in rows:
            m = re.match(r"FOR VALUES FROM \('([^']*)'\) TO \('([^']*)'\)", bound)
            if m:
                chain.append(f"v_now >= '{m[1]}' AND v_now < '{m[2]}' THEN\n"
                             + insert.replace("proto.keys AS k", f"proto.{name} AS k"))
        routed = claim.replace(insert, "IF " + "\n    ELSIF ".join(chain) + "\n    ELSE\n"
                               + insert + "\n    END IF;")
        conn.execute(rename(routed, "claim_parent", "claim", []))
        claim = conn.execute(get, ("proto.claim(text,text,bytea,interval)",)).fetchone()[0]
        nosec = [(r"\n\s*SECURITY DEFINER[^\n]*", ""), (r"\n\s*SET search_path[^\n]*", "")]
        conn.execute(rename(claim, "claim", "claim_nosec", nosec))
        conn.execute(rename(complete, "complete", "complete_nosec", nosec))
        conn.execute(rename(claim, "claim", "claim_consttoken", [(
            r"\(floor\(extract\(EPOCH FROM v_now\) - 1704067200\)::int8 << 32\)\s*\|"
            r" \('x' \|\| left\(gen_random_uuid\(\)::text, 8\)\)::bit\(32\)::int8",
            "1")]))


def rename(definition: str, old: str, new: str, edits: list[tuple[str, str]]) -> str:
    """A copy of proto.{old} named proto.{new}, with each edit (pattern, replacement) applied
    exactly once (all occurrences: the routed INSERT repeats)."""
    out = definition.replace(f"FUNCTION proto.{old}(", f"FUNCTION proto.{new}(", 1)
    for pattern, repl in edits:
        out, n = re.subn(pattern, repl, out, flags=re.S)
        if n == 0:
            raise SystemExit(f"variant {new}: {pattern!r} not found: stale edit")
    return out


def check_guarantees(db: str) -> None:
    """The prototype's answers on real rows: claimed, replay, mismatch, fenced complete."""
    fp, other = b"\x01" * 32, b"\x02" * 32
    with psycopg.connect(db, autocommit=True) as conn:
        claim = "SELECT outcome, lease_token, created_at FROM proto.claim('s', 'chk', %s)"
        out, tok, created = conn.execute(claim, (fp,)).fetchone()
        assert out == "claimed", out
        assert conn.execute(claim, (fp,)).fetchone()[0] == "in_progress"
        try:
            conn.execute("SELECT proto.complete('s', 'chk', %s, %s, 201, '\\x00', 'a/b')",
                         (tok + 1, created))
            raise AssertionError("complete with a wrong token succeeded")
        except psycopg.errors.ObjectNotInPrerequisiteState:
            pass
        conn.execute("SELECT proto.complete('s', 'chk', %s, %s, 201, '\\x00', 'a/b')",
                     (tok, created))
        assert conn.execute(claim, (fp,)).fetchone()[0] == "replay"
        assert conn.execute(claim, (other,)).fetchone()[0] == "mismatch"
        toks = [conn.execute("SELECT lease_token FROM proto.claim('s', 'k' || %s, %s)",
                             (i, fp)).fetchone()[0] & 0xFFFFFFFF for i in range(200)]
        assert len(set(toks)) >= 195, "low 32 bits of the tokens are not random"
    print("  prototype checks: claimed, in_progress, fenced complete (55000), replay, "
          "mismatch, random token bits: ok", flush=True)


STATEMENTS = """
SELECT regexp_replace(query, '\\s+', ' ', 'g'), calls,
       total_exec_time / calls * 1000
FROM pg_stat_statements WHERE calls >= 100 AND query NOT LIKE '%%pg_stat%%'
  AND query !~* '^(BEGIN|COMMIT)' ORDER BY query
"""


def run(flavour: str, mode: str, clients: int, args: argparse.Namespace) -> dict:
    conf = dict(STATS, **(FAST if mode == "fast" else DURABLE))
    with pgharness.PgServer(pgharness.flavour_bindir(flavour), extra_conf=conf,
                            name=f"proto-{flavour}") as server:
        server.run_psql(server.dsn(), "CREATE DATABASE bench")
        db = server.dsn("bench")
        for migration in sorted((ROOT / "migrations").glob("*.sql")):
            server.run_psql(db, migration, args=("-X", "-q", "-1", "-v", "ON_ERROR_STOP=1"))
        server.run_psql(db, SETUP_SQL.replace("{prefill}", str(args.prefill)))
        server.run_psql(db, BENCH / "prototype_v3.sql", args=("-X", "-q", "-1", "-v",
                                                               "ON_ERROR_STOP=1"))
        proto_partitions(db)
        server.run_psql(db, COPY_SQL)
        check_guarantees(db)
        tmp = server.tmpdir
        scripts = {"bare": BENCH / "bare.pgbench"}
        texts = [("engine", ENGINE), ("proto", PROTO)] + [
            (name, PROTO.replace("proto.claim(", f"proto.{cl}(").replace(
                "proto.complete(", f"proto.{co}(")) for name, (cl, co) in VARIANTS.items()]
        for name, text in texts:
            scripts[name] = tmp / f"proto_{name}.pgbench"
            scripts[name].write_text(text)
        for script in scripts.values():
            pgbench(server, script, 2, clients)
        with psycopg.connect(db, autocommit=True) as conn:
            conn.execute("SELECT pg_stat_statements_reset()")
        rounds = []
        for _ in range(args.rounds):
            tps = {name: pgbench(server, s, args.seconds, clients) for name, s in scripts.items()}
            rounds.append(tps)
            print(f"  {flavour} {mode:7s} c={clients} tps "
                  + " ".join(f"{n} {t:6.0f}" for n, t in tps.items()) + "   bare/X: "
                  + " ".join(f"{n} {tps['bare'] / t:.2f}" for n, t in tps.items()
                             if n != "bare"), flush=True)
        with psycopg.connect(db, autocommit=True) as conn:
            stmts = conn.execute(STATEMENTS).fetchall()
        for query, calls, us in stmts:
            print(f"    {us:7.1f} us  {calls:7d}  {query[:90]}")
        fn: dict[str, float] = defaultdict(float)  # mean us per call, by function or side
        for query, _, us in stmts:
            m = re.search(r"FROM (idempotency|proto)\.(\w+)\(|SELECT (idempotency|proto)"
                          r"\.(\w+)\(", query)
            if m:
                schema, name = (m[1], m[2]) if m[1] else (m[3], m[4])
                fn[name if schema == "proto" else "engine"] += us
            elif "bench_bare" in query:
                fn["bare"] += us
        per = {"bare": fn["bare"], "engine": fn["engine"],
               "proto": fn["claim"] + fn["complete"]}
        for name, (cl, co) in VARIANTS.items():
            per[name] = fn[cl] + fn[co]
        print("    statement time per claim+complete: "
              + ", ".join(f"{n} {us:.1f} us ({us / per['bare']:.2f}x)" for n, us in per.items()),
              flush=True)
        return {"flavour": flavour, "mode": mode, "clients": clients,
                "tps": {n: statistics.median(r["bare"] / r[n] for r in rounds)
                        for n in scripts if n != "bare"},
                "stmt": per}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default="pg15,pg18")
    parser.add_argument("--modes", default="durable,fast")
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--prefill", type=int, default=20_000)
    args = parser.parse_args()
    results = [run(f, m, args.clients, args) for f in args.servers.split(",")
               for m in args.modes.split(",")]
    print("\nmedians of the rounds (tps bare / tps X: server cost relative to the recipe) and "
          "pg_stat_statements exec time per claim+complete relative to the recipe's two:")
    for r in results:
        s = r["stmt"]
        print(f"  {r['flavour']} {r['mode']:7s} c={r['clients']} tps bare/X: "
              + " ".join(f"{n} {v:.2f}" for n, v in r["tps"].items()) + "   stmt time X/bare: "
              + " ".join(f"{n} {s[n] / s['bare']:.2f}" for n in s if n != "bare"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
