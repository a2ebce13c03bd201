#!/usr/bin/env python3
"""Engine v3 PROTOTYPE benchmark: bare recipe vs engine vs prototypes (bench/prototype_v3.sql).

NOT the engine: the prototypes live in bench/ and in schemas ``proto`` and ``proto_s`` of a
throwaway server, next to the current engine (migrations/*.sql). pgbench workloads, interleaved
round by round so machine noise hits them alike:

  bare      INSERT ... ON CONFLICT DO NOTHING + UPDATE on a plain table (bench/bare.pgbench)
  floor     the bare statements inside minimal SECURITY DEFINER PL/pgSQL functions
            (bench/floor.sql, bench/floor.pgbench)
  engine    idempotency.claim(fingerprint =>) + idempotency.complete_bytes (what the middleware
            sends)
  proto     proto.claim + proto.complete (one PL/pgSQL level each, inline checks and token,
            complete given the created_at claim returned: no directory read); proto_* are
            copies with one idea taken out
  s         design S: proto_s.claim + proto_s.complete (the key row is the arbiter: one
            unpartitioned table, claim = one insert; complete = fenced HOT update + one insert
            into the partitioned responses table); s_routed with the response insert (and the
            replay read) routed to the partition by static statements; s_hash with the arbiter
            on (scope, sha256(key)); s_ctid with responses unindexed, found by the ctid the
            key row keeps; s_inline the response in the key row (a floor, not a proposal);
            s_plain S's statements sent by the client, no function (not a proposal either);
            s_sql the success paths as LANGUAGE sql functions (claim_fast, complete_fast)
  replay_*  one claim of a completed (prefilled) key; the recipe's is its INSERT ... ON
            CONFLICT DO NOTHING + a SELECT of the row

Each run of a workload starts after a CHECKPOINT and a pg_stat_statements reset, and reports
its tps, its statement time per transaction (sum of pg_stat_statements total_exec_time, track =
top, over pgbench's transactions: claim + complete) and its WAL bytes per transaction
(pg_current_wal_insert_lsn delta; autovacuum is off so the window holds the workload's own WAL
only). Per round: each workload over the recipe (bare, or replay_bare for replay_*); at the end
the medians of those per-round ratios. Before the rounds it checks the prototypes' answers on
real rows (claimed, in_progress, wrong token fails, replay, mismatch, random token bits); after
them, how many of each table's updates were HOT.

    /work/main/.venv/bin/python bench/prototype_v3.py [--servers pg15,pg18]
        [--modes durable,fast] [--clients 4] [--seconds 5] [--rounds 3] [--prefill 20000]
        [--only bare,engine,proto,s,s_inline,replay_bare,replay_s]
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
# autovacuum off: the WAL of a run's window is the workload's own (pruning on access stays).
STATS = {"shared_preload_libraries": "pg_stat_statements", "pg_stat_statements.track": "top",
         "autovacuum": "off"}
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


def pgbench(server: pgharness.PgServer, script: Path, seconds: int,
            clients: int) -> tuple[float, int]:
    """(tps, transactions processed) of one pgbench run."""
    out = subprocess.run(
        [str(server.bindir / "pgbench"), "-n", "-M", "prepared", "-c", str(clients),
         "-j", str(min(clients, 2)), "-T", str(seconds), "-f", str(script),
         server.dsn("bench")],
        capture_output=True, text=True, check=False)
    match = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", out.stdout)
    done = re.search(r"number of transactions actually processed: (\d+)", out.stdout)
    if out.returncode != 0 or not match or not done:
        raise SystemExit(f"pgbench failed:\n{out.stdout}\n{out.stderr}")
    return float(match.group(1)), int(done.group(1))


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


def proto_partitions(db: str) -> list[tuple[str, str]]:
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
    return rows


def rename(definition: str, old: str, new: str, edits: list[tuple[str, str]],
           schema: str = "proto") -> str:
    """A copy of {schema}.{old} named {schema}.{new}, with each edit (pattern, replacement)
    applied at least once (all occurrences: the routed INSERT repeats)."""
    out = definition.replace(f"FUNCTION {schema}.{old}(", f"FUNCTION {schema}.{new}(", 1)
    for pattern, repl in edits:
        out, n = re.subn(pattern, repl, out, flags=re.S)
        if n == 0:
            raise SystemExit(f"variant {new}: {pattern!r} not found: stale edit")
    return out


S_COPY_SQL = """
INSERT INTO proto_s.keys (scope, key, fingerprint, state, lease_token, created_at,
                          completed_at, response_created_at)
SELECT scope, key, fingerprint, state, lease_token, created_at, completed_at, created_at
FROM idempotency.keys;
INSERT INTO proto_s.keys_h (scope, key_hash, key, fingerprint, state, lease_token, created_at,
                            completed_at, response_created_at)
SELECT scope, sha256(convert_to(key, 'UTF8')), key, fingerprint, state, lease_token,
       created_at, completed_at, created_at
FROM idempotency.keys;
INSERT INTO proto_s.responses (scope, key, created_at, status, headers, body_bytes,
                               content_type)
SELECT scope, key, created_at, response_status, response_headers,
       convert_to(response_body::text, 'UTF8'), 'application/json'
FROM idempotency.keys;
INSERT INTO proto_s.keys_inline (scope, key, fingerprint, state, lease_token, created_at,
                                 completed_at, response_status, response_headers,
                                 response_body_bytes, response_content_type)
SELECT scope, key, fingerprint, state, lease_token, created_at, completed_at, response_status,
       response_headers, convert_to(response_body::text, 'UTF8'), 'application/json'
FROM idempotency.keys;
"""

S_FRESH = r"""-- design S: the key row is the arbiter, complete needs no created_at
\set k random(1, 1000000000000)
SELECT lease_token AS tok FROM proto_s.CLAIM('acct_1', 'k' || :k,
    sha256('POST /payments {"amount":50}'::bytea)) \gset
SELECT proto_s.COMPLETE('acct_1', 'k' || :k, :tok, 201, '\x7b7d'::bytea,
    'application/json', '{}');
"""
# s_plain (not a proposal: it needs table privileges for the caller): design S's statements
# sent by the client itself, no function: what S's tables cost without PL/pgSQL around them.
# complete is one statement (the fenced update feeding the response insert).
S_PLAIN = r"""-- design S's statements without functions
\set k random(1, 1000000000000)
INSERT INTO proto_s.keys AS k (scope, key, fingerprint, state, lease_token, lease_expires_at,
                               created_at)
VALUES ('acct_1', 'k' || :k, sha256('POST /payments {"amount":50}'::bytea), 'in_progress',
        (floor(extract(EPOCH FROM now()) - 1704067200)::int8 << 32)
        | ('x' || left(gen_random_uuid()::text, 8))::bit(32)::int8,
        now() + interval '30 seconds', now())
ON CONFLICT (scope, key) DO NOTHING
RETURNING k.lease_token AS tok \gset
WITH done AS (
    UPDATE proto_s.keys AS k
    SET state = 'completed', completed_at = now(), response_created_at = now(),
        lease_expires_at = NULL
    WHERE k.scope = 'acct_1' AND k.key = 'k' || :k AND k.lease_token = :tok
      AND k.state = 'in_progress'
    RETURNING k.scope, k.key, k.response_created_at
)
INSERT INTO proto_s.responses (scope, key, created_at, status, headers, body_bytes,
                               content_type)
SELECT scope, key, response_created_at, 201, '{}', '\x7b7d'::bytea, 'application/json'
FROM done;
"""
S_VARIANTS = {  # workload: (claim, complete) in proto_s
    "s": ("claim", "complete"),
    "s_routed": ("claim_routed", "complete_routed"),
    "s_hash": ("claim_h", "complete_h"),
    "s_ctid": ("claim_ctid", "complete_ctid"),
    "s_inline": ("claim_inline", "complete_inline"),
}

# Replays: one claim of a prefilled completed key (run.SETUP_SQL: 'pre' || g in scope
# 'acct_' || g % 100, fingerprint sha256(g::text)). The recipe's replay is its conflicting
# INSERT and a SELECT of the row, as in bench/http.py.
REPLAY_BARE = r"""-- the recipe's replay: the conflicting insert, then the row
\set g random(1, PREFILL)
INSERT INTO bench_bare (scope, key, fingerprint, state, lease_token, lease_expires_at,
                        created_at)
VALUES ('acct_' || (:g::int % 100), 'pre' || :g, sha256(:g::text::bytea), 'in_progress', 1,
        now() + interval '30 seconds', now())
ON CONFLICT DO NOTHING;
SELECT fingerprint, state, response_status, response_headers, response_body FROM bench_bare
WHERE scope = 'acct_' || (:g::int % 100) AND key = 'pre' || :g;
"""
REPLAY = r"""-- replay of a completed key
\set g random(1, PREFILL)
SELECT outcome FROM CLAIM('acct_' || (:g::int % 100), 'pre' || :g, ARGS);
"""
REPLAYS = {  # workload: (function, its arguments after scope and key)
    "replay_engine": ("idempotency.claim", "NULL, fingerprint => sha256(:g::text::bytea)"),
    "replay_proto": ("proto.claim", "sha256(:g::text::bytea)"),
    "replay_s": ("proto_s.claim", "sha256(:g::text::bytea)"),
    "replay_s_routed": ("proto_s.claim_routed", "sha256(:g::text::bytea)"),
    "replay_s_inline": ("proto_s.claim_inline", "sha256(:g::text::bytea)"),
}

BOUND = r"FOR VALUES FROM \('([^']*)'\) TO \('([^']*)'\)"
KEY_BY_HASH = "sha256(convert_to(p_key, 'UTF8'))"


def route(definition: str, statement: str, var: str, parent: str,
          parts: list[tuple[str, str, str]]) -> str:
    """definition with statement (on the partitioned table parent) replaced by an IF chain on
    var, one static copy of the statement per partition; the parent in the ELSE branch."""
    chain = [f"{var} >= '{lo}' AND {var} < '{hi}' THEN\n"
             + statement.replace(f"{parent} AS", f"{part} AS") for part, lo, hi in parts]
    routed = ("IF " + "\n    ELSIF ".join(chain) + "\n    ELSE\n" + statement
              + "\n    END IF;")
    return definition.replace(statement, routed, 1)


def s_partitions(db: str, rows: list[tuple[str, str]]) -> None:
    """proto_s.responses gets the partition bounds of idempotency.keys; the routed and the
    by-hash copies of proto_s.claim and proto_s.complete are made from their definitions."""
    parts = []
    with psycopg.connect(db, autocommit=True) as conn:
        for name, bound in rows:
            part = "proto_s." + name.replace("keys", "responses", 1)
            conn.execute(f"CREATE TABLE {part} PARTITION OF proto_s.responses {bound}")
            conn.execute(f"CREATE TABLE {part}_t PARTITION OF proto_s.responses_t {bound}")
            m = re.match(BOUND, bound)
            if m:
                parts.append((part, m[1], m[2]))
        get = "SELECT pg_get_functiondef(%s::regprocedure)"
        claim = conn.execute(get, ("proto_s.claim(text,text,bytea,interval)",)).fetchone()[0]
        complete = conn.execute(get, ("proto_s.complete(text,text,bigint,integer,bytea,text,"
                                      "jsonb)",)).fetchone()[0]
        read = re.search(r"SELECT 'replay'.*?;", claim, re.S)[0]
        write = re.search(r"INSERT INTO proto_s\.responses AS r.*?;", complete, re.S)[0]
        conn.execute(rename(route(claim, read, "v_response_at", "proto_s.responses", parts),
                            "claim", "claim_routed", [], "proto_s"))
        conn.execute(rename(route(complete, write, "v_now", "proto_s.responses", parts),
                            "complete", "complete_routed", [], "proto_s"))
        by_hash = [(re.escape("proto_s.keys AS k"), "proto_s.keys_h AS k"),
                   (re.escape("k.key = p_key"), f"k.key_hash = {KEY_BY_HASH}")]
        conn.execute(rename(claim, "claim", "claim_h", by_hash + [
            (re.escape("(scope, key, fingerprint,"), "(scope, key_hash, key, fingerprint,"),
            (re.escape("VALUES (p_scope, p_key,"), f"VALUES (p_scope, {KEY_BY_HASH}, p_key,"),
            (re.escape("ON CONFLICT (scope, key)"), "ON CONFLICT (scope, key_hash)")],
            "proto_s"))
        conn.execute(rename(complete, "complete", "complete_h", by_hash, "proto_s"))
        # s_ctid: the response row inserted first (routed), its ctid kept in the key row by the
        # fenced update; the replay reads it by ctid (a TID scan of the one partition)
        tparts = [(f"{part}_t", lo, hi) for part, lo, hi in parts]
        ctid_read = read.replace("proto_s.responses AS r", "proto_s.responses_t AS r").replace(
            "r.created_at = v_response_at;", "r.created_at = v_response_at AND r.ctid = v_tid;")
        claim_ctid = rename(claim.replace(read, ctid_read), "claim", "claim_ctid", [
            (r"(v_response_at timestamptz;)", r"\1\n    v_tid tid;"),
            (r"k\.response_created_at(\s+INTO)", r"k.response_created_at, k.response_ctid\1"),
            (r"v_response_at(\s+FROM proto_s\.keys)", r"v_response_at, v_tid\1")], "proto_s")
        conn.execute(route(claim_ctid, ctid_read, "v_response_at", "proto_s.responses_t",
                           tparts))
        ctid_write = (write.replace("proto_s.responses AS r", "proto_s.responses_t AS r")
                      [:-1] + "\n    RETURNING r.ctid INTO v_tid;")
        complete_ctid = rename(complete.replace(write, ""), "complete", "complete_ctid", [
            (r"(v_now timestamptz := clock_timestamp\(\);)", r"\1\n    v_tid tid;"),
            (r"(\n\s*UPDATE proto_s\.keys AS k)", "\n    " + ctid_write.replace("\\", "\\\\")
             + r"\1"),
            (r"response_created_at = v_now,", "response_created_at = v_now, "
             "response_ctid = v_tid,")], "proto_s")
        conn.execute(route(complete_ctid, ctid_write, "v_now", "proto_s.responses_t", tparts))


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


def check_s(db: str, claim: str, complete: str) -> None:
    """Design S's answers on real rows: claimed, in_progress, a wrong token fails (55000), the
    stored response replayed, mismatch, takeover of an expired lease, random token bits."""
    fp, other = b"\x01" * 32, b"\x02" * 32
    key = f"chk_{claim}"
    ask = (f"SELECT outcome, lease_token, response_status, response_body_bytes, "
           f"response_content_type FROM proto_s.{claim}('s', %s, %s)")
    done = f"SELECT proto_s.{complete}('s', %s, %s, 201, '\\x00', 'a/b')"
    with psycopg.connect(db, autocommit=True) as conn:
        out, tok, *_ = conn.execute(ask, (key, fp)).fetchone()
        assert out == "claimed", out
        assert conn.execute(ask, (key, fp)).fetchone()[0] == "in_progress"
        try:
            conn.execute(done, (key, tok + 1))
            raise AssertionError(f"{complete} with a wrong token succeeded")
        except psycopg.errors.ObjectNotInPrerequisiteState:
            pass
        conn.execute(done, (key, tok))
        row = conn.execute(ask, (key, fp)).fetchone()
        assert (row[0], *row[2:]) == ("replay", 201, b"\x00", "a/b"), row
        assert conn.execute(ask, (key, other)).fetchone()[0] == "mismatch"
        short = (f"SELECT outcome, lease_token FROM proto_s.{claim}('s', %s, %s, "
                 f"'1 microsecond')")
        first = conn.execute(short, (key + "_t", fp)).fetchone()
        second = conn.execute(short, (key + "_t", fp)).fetchone()
        assert first[0] == "claimed" and second[0] == "resumed" and second[1] > first[1], (
            first, second)
        try:
            conn.execute(done, (key + "_t", first[1]))
            raise AssertionError(f"{complete} with the taken-over token succeeded")
        except psycopg.errors.ObjectNotInPrerequisiteState:
            pass
        toks = [conn.execute(ask, (f"{key}_{i}", fp)).fetchone()[1] & 0xFFFFFFFF
                for i in range(200)]
        assert len(set(toks)) >= 195, "low 32 bits of the tokens are not random"
    print(f"  proto_s.{claim} + {complete} checks: claimed, in_progress, fenced complete "
          "(55000), replay of the stored response, mismatch, takeover fenced, random token "
          "bits: ok", flush=True)


def check_fast(db: str) -> None:
    """s_sql's fast paths on real rows: claim_fast claims a new key and returns nothing for a
    known one or an invalid argument; complete_fast is fenced (false, row unchanged) and its
    response is what proto_s.claim replays."""
    fp = b"\x01" * 32
    fast = "SELECT lease_token FROM proto_s.claim_fast('s', %s, %s)"
    done = "SELECT proto_s.complete_fast('s', %s, %s, 201, '\\x00', 'a/b')"
    state = "SELECT state FROM proto_s.keys WHERE scope = 's' AND key = %s"
    with psycopg.connect(db, autocommit=True) as conn:
        tok = conn.execute(fast, ("chk_fast", fp)).fetchone()[0]
        assert conn.execute(fast, ("chk_fast", fp)).fetchall() == []
        assert conn.execute(fast, ("chk_fast_bad", b"\x01")).fetchall() == []
        assert conn.execute(done, ("chk_fast", tok + 1)).fetchone()[0] is False
        assert conn.execute(state, ("chk_fast",)).fetchone()[0] == "in_progress"
        assert conn.execute(done, ("chk_fast", tok)).fetchone()[0] is True
        assert conn.execute(done, ("chk_fast", tok)).fetchone()[0] is False
        row = conn.execute("SELECT outcome, response_status, response_body_bytes FROM "
                           "proto_s.claim('s', 'chk_fast', %s)", (fp,)).fetchone()
        assert row == ("replay", 201, b"\x00"), row
    print("  proto_s.claim_fast + complete_fast checks: claimed, no row for a known key or a bad "
          "argument, fenced complete (false, row unchanged), replay of the stored response: ok",
          flush=True)


def check_replays(db: str) -> None:
    """Each replay workload's claim answers 'replay' on a prefilled key."""
    with psycopg.connect(db, autocommit=True) as conn:
        for name, (fn, args) in REPLAYS.items():
            sql = (f"SELECT outcome FROM {fn}('acct_7', 'pre7', "
                   + args.replace(":g", "'7'") + ")")
            out = conn.execute(sql).fetchone()[0]
            assert out == "replay", (name, out)
    print("  replay workloads answer 'replay' on a prefilled key: ok", flush=True)


# what a run's statements cost: everything pgbench sent (not this script's own queries)
STATEMENTS = """
SELECT regexp_replace(query, '\\s+', ' ', 'g'), calls, total_exec_time
FROM pg_stat_statements
WHERE query NOT LIKE '%%pg_stat%%' AND query NOT LIKE '%%wal_%%lsn%%'
  AND query !~* '^(BEGIN|COMMIT|CHECKPOINT)'
"""
HOT = """
SELECT coalesce(i.inhparent, s.relid)::regclass::text, sum(s.n_tup_upd)::bigint,
       sum(s.n_tup_hot_upd)::bigint
FROM pg_stat_user_tables AS s LEFT JOIN pg_inherits AS i ON i.inhrelid = s.relid
GROUP BY 1 HAVING sum(s.n_tup_upd) > 0 ORDER BY 1
"""


def measure(server: pgharness.PgServer, stats: psycopg.Connection, script: Path,
            seconds: int, clients: int, totals: dict) -> dict:
    """One pgbench run of script after a CHECKPOINT: tps, statement time (us) and WAL (bytes)
    per transaction. Adds each statement's calls and time to totals."""
    stats.execute("CHECKPOINT")
    stats.execute("SELECT pg_stat_statements_reset()")
    lsn = stats.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0]
    tps, done = pgbench(server, script, seconds, clients)
    wal = stats.execute("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s::pg_lsn)"
                        "::float8", (lsn,)).fetchone()[0]
    ms = 0.0
    for query, calls, total in stats.execute(STATEMENTS).fetchall():
        ms += total
        totals[query][0] += calls
        totals[query][1] += total
    return {"tps": tps, "stmt": ms * 1000 / done, "wal": wal / done}


def over(x: float, base: float) -> float:
    """x / base; nan when the recipe's figure is 0 (a replay's WAL)."""
    return x / base if base else float("nan")


def baseline(name: str) -> str:
    return "replay_bare" if name.startswith("replay_") else "bare"


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
        server.run_psql(db, BENCH / "floor.sql", args=("-X", "-q", "-v", "ON_ERROR_STOP=1"))
        rows = proto_partitions(db)
        s_partitions(db, rows)
        server.run_psql(db, S_COPY_SQL + COPY_SQL)
        check_guarantees(db)
        for claim, complete in S_VARIANTS.values():
            check_s(db, claim, complete)
        check_fast(db)
        check_replays(db)
        tmp = server.tmpdir
        texts = [("engine", ENGINE), ("proto", PROTO)] + [
            (name, PROTO.replace("proto.claim(", f"proto.{cl}(").replace(
                "proto.complete(", f"proto.{co}(")) for name, (cl, co) in VARIANTS.items()]
        texts += [(name, S_FRESH.replace("CLAIM", cl).replace("COMPLETE", co))
                  for name, (cl, co) in S_VARIANTS.items()]
        texts += [("s_plain", S_PLAIN), ("s_sql", S_FRESH.replace("CLAIM", "claim_fast").replace(
            "COMPLETE", "complete_fast")), ("replay_bare", REPLAY_BARE)] + [
            (name, REPLAY.replace("CLAIM", fn).replace("ARGS", fargs))
            for name, (fn, fargs) in REPLAYS.items()]
        scripts = {"bare": BENCH / "bare.pgbench", "floor": BENCH / "floor.pgbench"}
        for name, text in texts:
            scripts[name] = tmp / f"proto_{name}.pgbench"
            scripts[name].write_text(text.replace("PREFILL", str(args.prefill)))
        if args.only:
            keep = set(args.only.split(","))
            keep |= {baseline(n) for n in keep}
            unknown = keep - set(scripts)
            if unknown:
                raise SystemExit(f"--only: unknown workloads {sorted(unknown)}; "
                                 f"known: {', '.join(scripts)}")
            scripts = {n: s for n, s in scripts.items() if n in keep}
        for script in scripts.values():
            pgbench(server, script, 2, clients)
        totals: dict[str, list] = defaultdict(lambda: [0, 0.0])
        rounds = []
        with psycopg.connect(db, autocommit=True) as stats:
            for i in range(args.rounds):
                res = {n: measure(server, stats, s, args.seconds, clients, totals)
                       for n, s in scripts.items()}
                rounds.append(res)
                for n, r in res.items():
                    b = res[baseline(n)]
                    print(f"  {flavour} {mode:7s} c={clients} round {i + 1} {n:22s} "
                          f"tps {r['tps']:6.0f} ({b['tps'] / r['tps']:.2f})  "
                          f"stmt {r['stmt']:6.1f} us ({r['stmt'] / b['stmt']:.2f}x)  "
                          f"WAL {r['wal']:6.0f} B ({over(r['wal'], b['wal']):.2f}x)", flush=True)
            hot = stats.execute(HOT).fetchall()
        print("    statements (all rounds): mean us per call, calls")
        for query, (calls, total) in sorted(totals.items()):
            if calls >= 100:
                print(f"    {total * 1000 / calls:7.1f} us  {calls:7d}  {query[:90]}")
        print("    updates, HOT updates: " + ", ".join(
            f"{rel} {upd} / {hot_upd} HOT ({hot_upd / upd:.0%})" for rel, upd, hot_upd in hot))
        summary = {}
        for n in scripts:
            b = baseline(n)
            summary[n] = {
                "stmt": statistics.median(r[n]["stmt"] for r in rounds),
                "wal": statistics.median(r[n]["wal"] for r in rounds),
                "stmt_x": statistics.median(r[n]["stmt"] / r[b]["stmt"] for r in rounds),
                "wal_x": statistics.median(over(r[n]["wal"], r[b]["wal"]) for r in rounds),
                "tps_x": statistics.median(r[b]["tps"] / r[n]["tps"] for r in rounds),
                "stmt_rounds": [r[n]["stmt"] / r[b]["stmt"] for r in rounds],
                "wal_rounds": [over(r[n]["wal"], r[b]["wal"]) for r in rounds],
            }
        return {"flavour": flavour, "mode": mode, "clients": clients, "summary": summary}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default="pg15,pg18")
    parser.add_argument("--modes", default="durable,fast")
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--prefill", type=int, default=20_000)
    parser.add_argument("--only", help="workloads to run (comma-separated; the recipe's "
                        "bare or replay_bare is always added), default all")
    args = parser.parse_args()
    results = [run(f, m, args.clients, args) for f in args.servers.split(",")
               for m in args.modes.split(",")]
    print("\nmedians of the rounds: per transaction (claim + complete, or one replay) statement "
          "time (pg_stat_statements, top) and WAL; X/recipe = median of the per-round ratios "
          "(recipe: bare, or replay_bare); tps recipe/X")
    for r in results:
        print(f"  {r['flavour']} {r['mode']} c={r['clients']}")
        for n, v in r["summary"].items():
            print(f"    {n:22s} stmt {v['stmt']:6.1f} us {v['stmt_x']:5.2f}x "
                  f"[{' '.join(f'{x:.2f}' for x in v['stmt_rounds'])}]   "
                  f"WAL {v['wal']:6.0f} B {v['wal_x']:5.2f}x "
                  f"[{' '.join(f'{x:.2f}' for x in v['wal_rounds'])}]   "
                  f"tps {v['tps_x']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
