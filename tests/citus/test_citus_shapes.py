"""Generated SQL around a per-key call: no Citus node goes down, and every answer is one server's.

A small grammar (below) writes the SQL a role allowed to call the per-key functions could send
around a call: sublinks in every clause, aggregates, grouping, ROLLUP, CUBE and grouping sets,
windows, DISTINCT, ORDER BY, LIMIT and OFFSET (constant or a sublink), row locks, ordinality,
ROWS FROM, LATERAL and joins, subqueries, CTEs (inlined or materialized), set operations; each
query then sent plainly, under EXPLAIN (with and without ANALYZE), through a cursor (plain,
scroll, with hold), as a prepared statement (custom and forced generic plans, EXPLAIN ANALYZE
EXECUTE), inside a transaction (twice, read only, around a savepoint), in a DO block (PERFORM,
dynamic EXECUTE), a COPY or a CREATE TABLE AS. The calls are claim,
heartbeat_outcome, inbox_accept and complete (the last always with a stale token: IK001).
The shapes are drawn with a fixed seed, so every run sends the same statements.

They run as the least-privilege request role (``grant_usage(kind => 'request')``), each shape
through one node (the coordinator or a worker, in turn; another one in the other mode), on both
Citus versions the project builds, against an install made by ``distribute()`` (no delegation,
the default) and by ``distribute(delegate => true)``; the three nodes' sessions run at once.
Each answer (the rows, normalised where they hold a token or a time, or the SQLSTATE) must
equal the same statements' answer on one server (a database without Citus on the coordinator's
server, with the same migrations and role). Afterwards every node is the same
running server: the watching sessions keep their pids and no log says "terminated by signal".

Against Citus 14.0.1 built without the guard (tools/build_citus.py's patch left out), the
default install's 900 shapes passed, through every node, and the delegated one crashed the
coordinator within the first shapes (``SELECT idempotency.inbox_accept(...) GROUP BY ROLLUP
(1)`` in a cursor): the test sees what the guard is for.
"""

from __future__ import annotations

import random
import re
import threading
import uuid
from collections.abc import Iterator
from datetime import date, datetime, timedelta
from typing import Any

import psycopg
import pytest
from helpers import MIGRATION_PSQL_ARGS, MIGRATIONS
from helpers.citus import Secured, installed
from psycopg import sql

SEED = 20261208
SHAPES = 900

# Each call: its SQL ({s} the scope, {k} the key), the alias a FROM item gives it and the
# column a query over it names.
CALLS = {
    "claim": ("idempotency.claim('{s}', '{k}', '{{}}')", "r", "r.outcome"),
    "heartbeat_outcome": ("idempotency.heartbeat_outcome('{s}', '{k}', 1)", "r", "r.outcome"),
    "inbox_accept": ("idempotency.inbox_accept('{s}', '{k}')", "r(v)", "r.v"),
    "complete": ("idempotency.complete('{s}', '{k}', 1, 200, '{{}}')", "r(v)", "r.v"),
}
# A query over the call in FROM: SELECT <target> FROM <from> <where> <group> <order> <limit>.
# {C} is the call, {A} its alias, {X} the column. A query with grouping takes its target from
# GROUPED (the others would only be 42803).
TARGETS = ["{X}", "*", "r", "{X}, (SELECT 1)", "(SELECT 1) AS one, {X}", "{X}, (SELECT {X})",
           "{X}, EXISTS (SELECT 1)", "{X}, 1 IN (SELECT 1)", "{X}, ARRAY(SELECT 1)",
           "{X}, row_number() OVER ()", "{X}, count(*) OVER (PARTITION BY {X})",
           "{X}::text", "{X} IS NULL", "DISTINCT {X}", "DISTINCT ON ({X}) {X}",
           "{X}, (SELECT 1 FROM (SELECT 1) AS s LIMIT (SELECT 1))", "{X}, 1 + 1",
           "{X}, CASE WHEN (SELECT true) THEN 1 END", "{X}, {X}", "{X}, r", "r.*"]
GROUPED = ["{X}", "{X}, count(*)", "count(*)", "{X}, (SELECT 1)", "{X}, (SELECT {X})",
           "{X}, grouping({X})", "{X}, sum(1) OVER ()", "DISTINCT {X}", "{X}, max((SELECT 1))"]
FROMS = ["{C} AS {A}", "{C} WITH ORDINALITY AS {A}", "ROWS FROM ({C}) AS {A}",
         "(SELECT 1) AS v, LATERAL {C} AS {A}", "{C} AS {A}, LATERAL (SELECT {X}) AS l",
         "{C} AS {A} JOIN (SELECT 1 AS one) AS j ON true", "(SELECT * FROM {C}) AS {A}",
         "(SELECT * FROM {C} OFFSET 0) AS {A}", "{C} AS {A} CROSS JOIN generate_series(1, 2) AS g",
         "(VALUES (1)) AS w(a) LEFT JOIN LATERAL {C} AS {A} ON true"]
WHERES = ["", "", "WHERE {X} IS NOT NULL", "WHERE EXISTS (SELECT 1)",
          "WHERE {X} IN (SELECT {X})", "WHERE (SELECT true)", "WHERE true"]
GROUPS = ["GROUP BY {X}", "GROUP BY ROLLUP ({X})", "GROUP BY GROUPING SETS (({X}), ())",
          "GROUP BY CUBE ({X})", "GROUP BY {X} HAVING count(*) > 0",
          "GROUP BY {X} HAVING (SELECT true)", "GROUP BY {X}, ()",
          "GROUP BY DISTINCT ROLLUP ({X}), ()"]
ORDERS = ["", "", "ORDER BY 1", "ORDER BY (SELECT 1)", "ORDER BY {X} DESC"]
LIMITS = ["", "", "LIMIT 1", "LIMIT (SELECT 1)", "OFFSET 0", "OFFSET (SELECT 0)", "LIMIT ALL",
          "FETCH FIRST 1 ROW ONLY", "FOR UPDATE", "LIMIT 1 OFFSET (SELECT 0)"]
# The call in the target list of a FROM-less query (or beside a FROM item).
SELECT_LIST = ["SELECT {C}", "SELECT {C}, (SELECT 1)", "SELECT ({C}).*", "SELECT ({C}) IS NULL",
               "SELECT {C} WHERE (SELECT true)", "SELECT {C} GROUP BY ROLLUP (1)",
               "SELECT {C} GROUP BY GROUPING SETS ((1), ())", "SELECT {C} ORDER BY (SELECT 1)",
               "SELECT {C} LIMIT (SELECT 1)", "SELECT {C} OFFSET (SELECT 0)",
               "SELECT {C} FROM (SELECT 1) AS v", "SELECT (SELECT {C})",
               "SELECT EXISTS (SELECT {C})", "SELECT {C} HAVING (SELECT true)",
               "SELECT DISTINCT {C}", "SELECT {C}, row_number() OVER ()", "SELECT count({C})",
               "SELECT {C} FROM generate_series(1, 2)", "SELECT {C} WHERE false",
               "SELECT 1 WHERE {C} IS NOT NULL", "SELECT 1 ORDER BY {C}",
               "SELECT {C} LIMIT 1", "SELECT {C} FOR UPDATE"]
# Around the query {Q}.
WRAPS = ["{Q}", "{Q}", "{Q}", "WITH c AS ({Q}) SELECT * FROM c",
         "WITH c AS MATERIALIZED ({Q}) SELECT * FROM c", "WITH c AS (SELECT 1) {Q}",
         "SELECT * FROM ({Q}) AS q", "SELECT (SELECT count(*) FROM ({Q}) AS q)",
         "SELECT count(*) FROM (({Q}) UNION ALL ({Q})) AS u", "({Q}) UNION ({Q})",
         "({Q}) EXCEPT ({Q})", "({Q}) INTERSECT ALL ({Q})",
         "SELECT * FROM (SELECT 1) AS v, LATERAL ({Q}) AS q"]
# How the statement is sent: the statements of one session, {W} the query. A prepared
# statement takes the scope as its parameter.
SENDS = {
    "plain": ["{W}"],
    "explain": ["EXPLAIN (COSTS OFF) {W}"],
    "explain-analyze": ["EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF) {W}"],
    "explain-analyze-verbose": ["EXPLAIN (ANALYZE, VERBOSE, BUFFERS, FORMAT JSON) {W}"],
    "cursor": ["BEGIN", "DECLARE c CURSOR FOR {W}", "FETCH ALL FROM c", "CLOSE c", "COMMIT"],
    "scroll-cursor": ["BEGIN", "DECLARE c SCROLL CURSOR FOR {W}", "FETCH LAST FROM c",
                      "FETCH ABSOLUTE 1 FROM c", "COMMIT"],
    "cursor-with-hold": ["DECLARE c CURSOR WITH HOLD FOR {W}", "FETCH ALL FROM c", "CLOSE c"],
    "prepared": ["PREPARE p(text) AS {P}", *["EXECUTE p('{s}')"] * 6],
    "prepared-generic": ["SET plan_cache_mode = force_generic_plan", "PREPARE p(text) AS {P}",
                         "EXECUTE p('{s}')", "EXECUTE p('{s}')"],
    "explain-execute": ["PREPARE p(text) AS {P}", "EXECUTE p('{s}')",
                        "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF) EXECUTE p('{s}')"],
    "transaction": ["BEGIN", "{W}", "{W}", "COMMIT"],
    "read-only": ["BEGIN READ ONLY", "{W}", "COMMIT"],
    "savepoint": ["BEGIN", "SAVEPOINT a", "{W}", "ROLLBACK TO SAVEPOINT a", "{W}", "COMMIT"],
    "do": ["DO $do$ BEGIN PERFORM FROM ({W}) AS q; END $do$"],
    "do-execute": ["DO $do$ BEGIN EXECUTE $q$ {W} $q$; END $do$"],
    "copy": ["COPY ({W}) TO STDOUT"],
    "create-table-as": ["CREATE TEMP TABLE t AS {W}", "SELECT * FROM t", "DROP TABLE t"],
}
# As many sends as no multiple of 3 (entry points) or 4 (calls): every send meets every call
# and every node.
assert len(SENDS) % 2 and len(SENDS) % 3
# Statements after which the session is reset (DISCARD ALL) before the next shape.
RESETS = ("PREPARE", "SET ", "CREATE TEMP")
ENTRY_POINTS = ["coordinator", "worker1", "worker2"]

TIME = re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(\.\d+)?([+-]\d\d(:\d\d)?)?")
DURATION = re.compile(r"(\d+ days? )?-?\d\d:\d\d:\d\d(\.\d+)?")
TOKEN = re.compile(r"-?\d{7,}")


def _query(rng: random.Random, call: str, alias: str, column: str) -> str:
    if rng.random() < 0.25:
        query = rng.choice(SELECT_LIST)
    else:
        grouped = rng.random() < 0.3
        target = rng.choice(GROUPED if grouped else TARGETS)
        parts = [f"SELECT {target} FROM {rng.choice(FROMS)}", rng.choice(WHERES),
                 rng.choice(GROUPS) if grouped else "", rng.choice(ORDERS), rng.choice(LIMITS)]
        query = " ".join(p for p in parts if p)
    query = rng.choice(WRAPS).replace("{Q}", query)
    return query.replace("{X}", column).replace("{A}", alias).replace("{C}", call)


def shapes() -> list[tuple[str, list[str]]]:
    """(id, statements) for SHAPES generated shapes: the calls and the sends in turn (every
    pair of them about equally often), each query drawn from the grammar with SEED."""
    rng = random.Random(SEED)
    out: list[tuple[str, list[str]]] = []
    names = list(CALLS)
    for i in range(SHAPES):
        fn = names[i % len(names)]
        call, alias, column = CALLS[fn]
        send = list(SENDS)[i % len(SENDS)]
        query = _query(rng, call, alias, column)
        prepared = query.replace("'{s}'", "$1")
        statements = [s.replace("{W}", query).replace("{P}", prepared) for s in SENDS[send]]
        out.append((f"{i}-{fn}-{send}", statements))
    return out


def _normalise(value: object) -> str:
    """A value, or a row of them, with every time, duration and token replaced by a letter:
    the rest of an answer does not depend on when or where it ran."""
    if isinstance(value, tuple):
        return "(" + ", ".join(_normalise(v) for v in value) + ")"
    if isinstance(value, (datetime, date)):
        return "T"
    if isinstance(value, timedelta):
        return "D"
    text = TIME.sub("T", str(value))
    text = DURATION.sub("D", text)
    return TOKEN.sub("N", text)


def _run(conn: psycopg.Connection[Any], statements: list[str], scope: str) -> list[Any]:
    """Each statement's answer until the first error: its rows (normalised and sorted; "plan"
    for EXPLAIN), or the error's SQLSTATE ("lost" for a cut connection)."""
    answers: list[Any] = []
    try:
        for statement in statements:
            text = statement.format(s=scope, k="k")
            with conn.cursor() as cur:
                if text.startswith("COPY"):
                    with cur.copy(text) as copy:
                        rows = [_normalise(bytes(block).decode()) for block in copy]
                    answers.append(sorted(rows))
                    continue
                cur.execute(text)
                if text.startswith("EXPLAIN"):
                    answers.append("plan" if cur.fetchall() else "no plan")
                elif cur.description:
                    answers.append(sorted(_normalise(row) for row in cur.fetchall()))
                else:
                    answers.append(None)
    except psycopg.Error as exc:
        answers.append(exc.sqlstate or "lost")
        if conn.closed:
            return answers
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        conn.execute("ROLLBACK")
    if any(s.startswith(RESETS) for s in statements):
        conn.execute("DISCARD ALL")
    return answers


def _answers(dsn: str, shapes: list[tuple[str, list[str]]], prefix: str) -> dict[str, Any]:
    """Every shape's answer, in one session (a new one after a lost connection)."""
    out: dict[str, Any] = {}
    conn = psycopg.connect(dsn, autocommit=True, prepare_threshold=None)
    try:
        for i, (name, statements) in enumerate(shapes):
            if conn.closed:
                conn = psycopg.connect(dsn, autocommit=True, prepare_threshold=None)
            out[name] = _run(conn, statements, f"{prefix}{i}")
    finally:
        conn.close()
    return out


@pytest.fixture(scope="module")
def generated() -> list[tuple[str, list[str]]]:
    return shapes()


@pytest.fixture(scope="module")
def role_and_reference(citus_cluster: Any, generated: list[tuple[str, list[str]]]
                       ) -> Iterator[tuple[str, dict[str, Any]]]:
    """The request role (on the coordinator's server) and the answers of one server: a
    database there without Citus, installed with the migrations."""
    role = f"request_{uuid.uuid4().hex[:6]}"
    node = citus_cluster.coordinator
    db = f"idem_ref_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(node.dsn("postgres"), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(db)))
    # On every node: Citus propagates a role only when it is created in a Citus database.
    for each in citus_cluster.nodes:
        with psycopg.connect(each.dsn("postgres"), autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    for migration in sorted(MIGRATIONS.glob("*.sql")):
        node.run_psql(node.dsn(db), migration, args=MIGRATION_PSQL_ARGS)
    with psycopg.connect(node.dsn(db), autocommit=True) as conn:
        conn.execute("SELECT idempotency.grant_usage(%s::regrole, kind => 'request')", (role,))
    reference = _answers(node.dsn(db, user=role), generated, "g")
    yield role, reference
    with psycopg.connect(node.dsn("postgres"), autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(db)))


def test_generated_shapes_answer_as_one_server_and_no_node_goes_down(
        citus_cluster: Any, role_and_reference: tuple[str, dict[str, Any]],
        generated: list[tuple[str, list[str]]]) -> None:
    """distribute() first, then distribute(delegate => true) in the same database."""
    role, reference = role_and_reference
    cluster = installed(citus_cluster, "idem_shapes", 4, delegate=False)
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        conn.execute("SELECT idempotency.grant_usage(%s::regrole, kind => 'request')", (role,))
    for delegate in (False, True):
        with psycopg.connect(cluster.dsn, autocommit=True) as conn:
            conn.execute("SELECT idempotency.distribute(delegate => %s)", (delegate,))
            delegated = conn.execute(
                "SELECT count(*) FROM pg_dist_object"
                " WHERE distribution_argument_index IS NOT NULL").fetchone()[0]
        assert (delegated > 0) == delegate
        _check_mode(cluster, role, reference, generated, delegate)


def _check_mode(cluster: Any, role: str, reference: dict[str, Any],
                generated: list[tuple[str, list[str]]], delegate: bool) -> None:
    watched = Secured(cluster, role)
    answers: dict[str, dict[str, Any]] = {}
    # Each shape through one node, a different one in each mode: every node gets every call,
    # send and clause.
    turn = {name: ENTRY_POINTS[(i + delegate) % len(ENTRY_POINTS)]
            for i, (name, _) in enumerate(generated)}

    def run(entry: str) -> None:
        dsn = watched.nodes[entry].dsn(cluster.db, user=role)
        answers[entry] = _answers(dsn, [s for s in generated if turn[s[0]] == entry],
                                  f"g{int(delegate)}{entry[0]}{entry[-1]}")

    # The three entry points at once: each is its own session, as three clients would be.
    threads = [threading.Thread(target=run, args=(entry,)) for entry in ENTRY_POINTS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    mode = "delegate => true" if delegate else "default"
    try:
        watched.assert_every_node_up()
    except (AssertionError, psycopg.Error) as exc:
        raise AssertionError(f"{mode}: a node went down: {exc}") from exc
    finally:
        watched.close()
    assert set(answers) == set(ENTRY_POINTS), mode
    wrong = [(turn[name], name, statements, reference[name], answers[turn[name]][name])
             for name, statements in generated if answers[turn[name]][name] != reference[name]]
    assert wrong == [], (f"{mode}: {len(wrong)} of {len(generated)} answers differ; "
                         f"first: {wrong[:5]}")
