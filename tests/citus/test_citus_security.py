"""No SQL the request role can send takes a Citus node down.

Every shape of call of the package's delegated functions that we know of, run as the request
role (made with ``grant_usage`` on the coordinator, as docs/install.md says) through the
coordinator and straight to each worker, on both Citus versions the project builds (14.0.1 /
PG 18 and 13.2.2 / PG 15). Each shape must answer: rows, or the SQLSTATE written next to it
(docs/errors.md, docs/scale-out.md "Limits"). Afterwards every node must still be the same
running server: an already-open session on the coordinator and on each worker still answers
with the same backend pid, the postmaster pid is unchanged, and no "terminated by signal"
appears in any node's log.

The install is delegated (``distribute(delegate => true)``), on the project's Citus builds,
which delegate only the plain call forms (tools/build_citus.py). Two of these shapes crashed
unpatched Citus (a segmentation fault, every session of the node cut): a NULL distribution
argument and a call in a FROM-subquery that PostgreSQL pulls up (also reached through an
inlined CTE, a view or an inlined SQL function); docs/scale-out.md has the upstream report.
With an unpatched build these tests fail (the crashed statement has no SQLSTATE and the
watching sessions are cut). test_citus_shapes.py generates many more shapes, in both modes.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from helpers.citus import Secured, installed
from psycopg import sql

ROWS = "rows"
# (id, statements, expected answer). {s} is a fresh scope, {k} a key; the statements run in
# one autocommit session of the request role; the answer is the last statement's rows or the
# first error's SQLSTATE. A dict gives the answer by entry point where they differ, a tuple
# the answers allowed where the shard's placement decides.
CALL = "idempotency.claim('{s}', '{k}', '{{}}')"
SHAPES: list[tuple[str, list[str], Any]] = [
    ("top-level-from", [f"SELECT outcome FROM {CALL}"], ROWS),
    ("top-level-select-list", [f"SELECT {CALL}"], ROWS),
    # The shape of issue 33: SIGSEGV in Citus's planner before the patch.
    ("pulled-up-subquery", [f"SELECT * FROM (SELECT r.outcome FROM {CALL} AS r) AS q"], ROWS),
    ("pulled-up-subquery-star", [f"SELECT * FROM (SELECT * FROM {CALL}) AS q"], ROWS),
    ("nested-pulled-up-subqueries",
     [f"SELECT * FROM (SELECT * FROM (SELECT outcome FROM {CALL}) AS a) AS b"], ROWS),
    ("subquery-offset-0", [f"SELECT * FROM (SELECT * FROM {CALL} OFFSET 0) AS q"], ROWS),
    ("inlined-cte", [f"WITH c AS (SELECT * FROM {CALL}) SELECT outcome FROM c"], ROWS),
    ("materialized-cte",
     [f"WITH c AS MATERIALIZED (SELECT * FROM {CALL}) SELECT outcome FROM c"], ROWS),
    ("cte-of-select-list-call", [f"WITH c AS (SELECT {CALL} AS r) SELECT (r).outcome FROM c"],
     ROWS),
    ("field-of-call", [f"SELECT ({CALL}).outcome"], ROWS),
    ("star-of-call", [f"SELECT ({CALL}).*"], ROWS),
    ("where-on-from-call", [f"SELECT * FROM {CALL} WHERE outcome = 'claimed'"], ROWS),
    ("call-in-where", [f"SELECT 1 WHERE ({CALL}).outcome IS NOT NULL"], ROWS),
    ("order-by-limit", [f"SELECT outcome FROM {CALL} ORDER BY 1 LIMIT 1"], ROWS),
    ("call-in-order-by", [f"SELECT 1 ORDER BY {CALL}"], ROWS),
    ("group-by", [f"SELECT outcome, count(*) FROM {CALL} GROUP BY outcome"], ROWS),
    ("distinct", [f"SELECT DISTINCT outcome FROM {CALL}"], ROWS),
    ("aggregate", [f"SELECT count(*) FROM {CALL}"], ROWS),
    ("column-aliases", [f"SELECT a FROM {CALL} AS r(a, b)"], ROWS),
    ("with-ordinality", [f"SELECT * FROM {CALL} WITH ORDINALITY"], ROWS),
    ("rows-from-two-calls", ["SELECT * FROM ROWS FROM (idempotency.claim('{s}', '{k}1', '{{}}'),"
                             " idempotency.claim('{s}', '{k}2', '{{}}'))"], ROWS),
    ("two-calls-in-from", ["SELECT * FROM idempotency.claim('{s}', '{k}1', '{{}}') AS a,"
                           " idempotency.claim('{s}', '{k}2', '{{}}') AS b"], ROWS),
    ("two-calls-in-select-list", ["SELECT idempotency.claim('{s}', '{k}1', '{{}}'),"
                                  " idempotency.claim('{s}', '{k}2', '{{}}')"], ROWS),
    ("union-all", ["SELECT outcome FROM idempotency.claim('{s}', '{k}1', '{{}}') UNION ALL"
                   " SELECT outcome FROM idempotency.claim('{s}', '{k}2', '{{}}')"], ROWS),
    ("lateral-over-values", ["SELECT c.outcome FROM (VALUES ('{k}1'), ('{k}2')) AS v(k),"
                             " LATERAL idempotency.claim('{s}', v.k, '{{}}') AS c"], ROWS),
    ("values-join-on-scope", ["SELECT c.outcome FROM (VALUES ('{s}')) AS v(s) JOIN LATERAL"
                              " idempotency.claim(v.s, '{k}', '{{}}') AS c ON true"], ROWS),
    ("call-over-generate-series",
     ["SELECT idempotency.claim('{s}', '{k}' || g, '{{}}') FROM generate_series(1, 2) AS g"],
     ROWS),
    ("scalar-subquery", [f"SELECT (SELECT outcome FROM {CALL})"], ROWS),
    ("exists", [f"SELECT EXISTS (SELECT FROM {CALL})"], ROWS),
    ("subquery-in-argument", ["SELECT * FROM idempotency.claim((SELECT '{s}'), '{k}', '{{}}')"],
     ROWS),
    ("varchar-scope", ["SELECT * FROM idempotency.claim('{s}'::varchar, '{k}', '{{}}')"], ROWS),
    ("stable-cast-in-request",
     ["SELECT * FROM idempotency.claim('{s}', '{k}', '{{}}'::text::jsonb)"], ROWS),
    # A key cast through name (a collatable type): a new key is claimed by claim's local
    # half, on the shard itself; a taken one goes on through Citus, which refuses the forced
    # delegation with 0A000 "queries must filter by the distribution argument in the same
    # colocation group when using the forced function pushdown" (an answer, not a crash;
    # docs/scale-out.md).
    ("key-cast-through-name",
     ["SELECT * FROM idempotency.claim('{s}', '{k}'::name::text, '{{}}')"], ROWS),
    ("key-cast-through-name-taken",
     [f"SELECT * FROM {CALL}",
      "SELECT * FROM idempotency.claim('{s}', '{k}'::name::text, '{{}}')"], "0A000"),
    ("named-notation", ["SELECT * FROM idempotency.claim(scope => '{s}', key => '{k}',"
                        " request => '{{}}', strict => true)"], ROWS),
    ("volatile-argument",
     ["SELECT * FROM idempotency.claim('{s}', '{k}' || random()::text, '{{}}')"], ROWS),
    # NULL distribution arguments: SIGSEGV in Citus's delegation before the patch.
    ("null-scope-from", ["SELECT * FROM idempotency.claim(NULL, '{k}', '{{}}')"], "IK010"),
    ("null-scope-select-list", ["SELECT idempotency.claim(NULL, '{k}', '{{}}')"], "IK010"),
    ("null-scope-folded",
     ["SELECT * FROM idempotency.claim(NULLIF('{s}', '{s}'), '{k}', '{{}}')"], "IK010"),
    ("null-scope-typed", ["SELECT * FROM idempotency.claim(NULL::text, '{k}', '{{}}')"], "IK010"),
    ("null-scope-in-subquery",
     ["SELECT * FROM (SELECT * FROM idempotency.claim(NULL, '{k}', '{{}}')) AS q"], "IK010"),
    ("null-key-and-request", ["SELECT * FROM idempotency.claim('{s}', NULL, NULL)"], "IK010"),
    ("null-consumer", ["SELECT idempotency.inbox_accept(NULL, 'm')"], "IK010"),
    ("null-complete-scope", ["SELECT idempotency.complete(NULL, '{k}', 1, 200, '{{}}')"],
     "IK010"),
    ("null-heartbeat-scope", ["SELECT * FROM idempotency.heartbeat(NULL, '{k}', 1)"], "IK010"),
    ("heartbeat-in-subquery",
     ["SELECT * FROM (SELECT * FROM idempotency.heartbeat('{s}', '{k}', 1)) AS q"], "IK001"),
    ("complete-in-subquery", ["SELECT * FROM (SELECT * FROM idempotency.complete('{s}', '{k}', 1,"
                              " 200, '{{}}')) AS q"], "IK001"),
    ("complete-bytes-in-cte", ["WITH c AS (SELECT * FROM idempotency.complete_bytes('{s}', '{k}',"
                               " 1, 200, '\\x00', 'a/b')) SELECT * FROM c"], "IK001"),
    ("checkpoint-in-subquery", ["SELECT * FROM (SELECT * FROM idempotency.checkpoint('{s}', '{k}',"
                                " 1, 'p')) AS q"], "IK001"),
    ("accept-in-subquery", ["SELECT * FROM (SELECT * FROM idempotency.accept('{s}', '{k}', 1,"
                            " 202, '{{}}')) AS q"], "IK001"),
    ("inbox-accept-in-subquery",
     ["SELECT * FROM (SELECT * FROM idempotency.inbox_accept('{s}', '{k}')) AS q"], ROWS),
    ("release-in-cte", ["WITH r AS (SELECT * FROM idempotency.release('{s}', '{k}', 1))"
                        " SELECT * FROM r"], "IK001"),
    ("prepared-custom-plans",
     ["PREPARE p(text, text) AS SELECT outcome FROM idempotency.claim($1, $2, '{{}}')",
      *[f"EXECUTE p('{{s}}', '{{k}}{i}')" for i in range(7)]], ROWS),
    ("prepared-force-generic-plan",
     ["SET plan_cache_mode = force_generic_plan",
      "PREPARE p(text, text) AS SELECT outcome FROM idempotency.claim($1, $2, '{{}}')",
      *[f"EXECUTE p('{{s}}', '{{k}}{i}')" for i in range(3)]], ROWS),
    ("prepared-generic-null-scope",
     ["SET plan_cache_mode = force_generic_plan",
      "PREPARE p(text) AS SELECT outcome FROM idempotency.claim($1, '{k}', '{{}}')",
      "EXECUTE p(NULL)"], "IK010"),
    ("prepared-generic-select-list-null-scope",
     ["SET plan_cache_mode = force_generic_plan",
      "PREPARE p(text) AS SELECT idempotency.claim($1, '{k}', '{{}}')",
      "EXECUTE p('{s}')", "EXECUTE p(NULL)"], "IK010"),
    ("prepared-generic-subquery",
     ["SET plan_cache_mode = force_generic_plan",
      "PREPARE p(text) AS SELECT * FROM (SELECT outcome FROM idempotency.claim($1, '{k}',"
      " '{{}}')) AS q", "EXECUTE p('{s}')"], ROWS),
    ("prepared-custom-subquery",
     ["PREPARE p(text) AS SELECT * FROM (SELECT outcome FROM idempotency.claim($1, '{k}',"
      " '{{}}')) AS q", *["EXECUTE p('{s}')"] * 7], ROWS),
    ("do-block-perform", [f"DO $$ BEGIN PERFORM {CALL}; END $$"], None),
    ("do-block-select-into-subquery",
     [f"DO $$ DECLARE o text; BEGIN SELECT q.outcome INTO o FROM (SELECT * FROM {CALL}) AS q;"
      " END $$"], None),
    ("do-block-null-scope",
     ["DO $$ BEGIN PERFORM idempotency.claim(NULL, '{k}', '{{}}'); END $$"], "IK010"),
    ("do-block-dynamic-subquery",
     ["DO $$ BEGIN EXECUTE 'SELECT * FROM (SELECT * FROM idempotency.claim($1, $2, ''{{}}''))"
      " AS q' USING '{s}', '{k}'; END $$"], None),
    ("transaction-subquery", ["BEGIN", f"SELECT * FROM (SELECT outcome FROM {CALL}) AS q",
                              "COMMIT"], None),
    ("transaction-null-scope", ["BEGIN", "SELECT idempotency.claim(NULL, '{k}', '{{}}')"],
     "IK010"),
    # A delegated call, then a call of the same scope that is not delegated, in one
    # transaction: on the coordinator Citus refuses the second (25001, "cannot perform query
    # on placements that were modified in this transaction by a different user": the body
    # runs as the functions' owner there); documented. On a worker the same when the shard is
    # on the other worker, rows when it is local (the scope is random: either).
    ("transaction-delegated-then-subquery",
     ["BEGIN", "SELECT outcome FROM idempotency.claim('{s}', '{k}1', '{{}}')",
      "SELECT * FROM (SELECT outcome FROM idempotency.claim('{s}', '{k}2', '{{}}')) AS q"],
     {"coordinator": "25001", "worker": (ROWS, "25001")}),
    ("cursor-subquery", ["BEGIN", f"DECLARE c CURSOR FOR SELECT * FROM (SELECT * FROM {CALL})"
                         " AS q", "FETCH ALL FROM c"], ROWS),
    ("cursor-top-level", ["BEGIN", f"DECLARE c CURSOR FOR SELECT * FROM {CALL}",
                          "FETCH ALL FROM c"], ROWS),
    # A temporary view or SQL function is expanded into a pulled-up subquery. Citus does not
    # allow creating them on a worker (XX000 "operation is not allowed on this node").
    ("temp-view", [f"CREATE TEMP VIEW v AS SELECT * FROM {CALL}", "SELECT outcome FROM v"],
     {"coordinator": ROWS, "worker": "XX000"}),
    ("inlined-temp-sql-function",
     ["CREATE FUNCTION pg_temp.f(s text) RETURNS SETOF idempotency.claim_result LANGUAGE sql"
      " AS $$ SELECT * FROM idempotency.claim(s, '{k}', '{{}}') $$",
      "SELECT outcome FROM pg_temp.f('{s}')"], {"coordinator": ROWS, "worker": "XX000"}),
    ("insert-select-into-temp-table",
     ["CREATE TEMP TABLE t (o text)", f"INSERT INTO t SELECT outcome FROM {CALL}",
      "SELECT o FROM t"], ROWS),
    ("create-temp-table-as",
     [f"CREATE TEMP TABLE t2 AS SELECT * FROM (SELECT * FROM {CALL}) AS q",
      "SELECT outcome FROM t2"], ROWS),
    ("copy-subquery", [f"COPY (SELECT * FROM (SELECT * FROM {CALL}) AS q) TO STDOUT"], ROWS),
    ("explain-subquery", [f"EXPLAIN SELECT * FROM (SELECT * FROM {CALL}) AS q"], ROWS),
    ("explain-analyze-subquery",
     [f"EXPLAIN ANALYZE SELECT * FROM (SELECT * FROM {CALL}) AS q"], ROWS),
    ("explain-analyze-top-level", [f"EXPLAIN ANALYZE SELECT * FROM {CALL}"], ROWS),
    ("empty-scope", ["SELECT * FROM idempotency.claim('', '{k}', '{{}}')"], "IK011"),
    ("long-scope", ["SELECT * FROM idempotency.claim(repeat('x', 100000), '{k}', '{{}}')"],
     "IK012"),
]
ENTRY_POINTS = ["coordinator", "worker1", "worker2"]


@pytest.fixture(scope="module")
def secured(citus_cluster: Any) -> Iterator[Secured]:
    cluster = installed(citus_cluster, "idem_sec", 4)
    role = f"request_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        conn.execute("SELECT idempotency.grant_usage(%s::regrole, kind => 'request')", (role,))
    watched = Secured(cluster, role)
    yield watched
    watched.close()


def _answer(conn: psycopg.Connection[Any], statements: list[str]) -> Any:
    """The last statement's rows (ROWS) or the first error's SQLSTATE; None for a last
    statement without rows. A lost connection has no SQLSTATE: it is reported as such."""
    scope = f"sec_{uuid.uuid4().hex[:10]}"
    try:
        rows = None
        for statement in statements:
            text = statement.format(s=scope, k="k")
            with conn.cursor() as cur:
                if text.startswith("COPY"):
                    with cur.copy(text) as copy:
                        rows = [bytes(block) for block in copy]
                    continue
                cur.execute(text)
                rows = cur.fetchall() if cur.description else None
        return ROWS if rows else None
    except psycopg.Error as exc:
        if exc.sqlstate is None:
            return f"connection lost: {exc}"
        return exc.sqlstate


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize(("statements", "expected"), [s[1:] for s in SHAPES],
                         ids=[s[0] for s in SHAPES])
def test_every_known_shape_answers_and_no_node_goes_down(
        secured: Secured, entry: str, statements: list[str], expected: Any) -> None:
    if isinstance(expected, dict):
        expected = expected["coordinator" if entry == "coordinator" else "worker"]
    node = secured.nodes[entry]
    with psycopg.connect(node.dsn(secured.cluster.db, user=secured.role),
                         autocommit=True) as conn:
        answer = _answer(conn, statements)
    assert answer in (expected if isinstance(expected, tuple) else (expected,))
    secured.assert_every_node_up()


def test_the_patched_shapes_are_not_delegated(secured: Secured) -> None:
    """The build's guards are what answer the two crash shapes (not a lucky plan): with
    client_min_messages = debug1 Citus says it declined to push each call down."""
    with psycopg.connect(secured.cluster.coordinator.dsn(secured.cluster.db, user=secured.role),
                         autocommit=True) as conn:
        notices: list[str] = []
        conn.add_notice_handler(lambda diag: notices.append(diag.message_primary or ""))
        conn.execute("SET client_min_messages = debug1")
        conn.execute(f"SELECT * FROM (SELECT r.outcome FROM {CALL} AS r) AS q"
                     .format(s=f"sec_{uuid.uuid4().hex[:10]}", k="k"))
        subquery = [n for n in notices if "more than one range table entry" in n]
        notices.clear()
        with pytest.raises(psycopg.Error) as info:
            conn.execute("SELECT * FROM idempotency.claim(NULL, 'k', '{}')")
        null = [n for n in notices if "distribution argument value is NULL" in n]
    assert subquery, notices
    assert null and info.value.sqlstate == "IK010", (notices, info.value)
