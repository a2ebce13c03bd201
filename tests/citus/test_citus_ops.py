"""Issue 23's operator functions on a real Citus cluster (harness/citus_cluster.py: a coordinator
and two workers), installed as docs/scale-out.md says: the migrations on the coordinator, then
``SELECT idempotency.distribute()``.

Checked through the coordinator, with keys spread over the shards of both workers:
- distribute() creates the new functions on every node and leaves grants and maintenance_runs
  on the coordinator;
- metrics() and metrics_by_scope() give the exact counts of keys in each state, and estimates
  read from the shards' statistics (the coordinator's own partitions are empty);
- maintain() works, is recorded in maintenance_runs, and metrics() follows its drops;
- inspect_key() and force_release() find a key in its shard, and a monitor role reads metrics.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from helpers import MIGRATION_PSQL_ARGS, MIGRATIONS
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import dict_row

from pgharness import wait_until

SCOPES = [f"tenant_{i}" for i in range(6)]
HOURS_AGO = 2
NEW_FUNCTIONS = ("_maintain(timestamp with time zone)", "_reapply_grants()",
                 "force_release(text,text)", "inspect_key(text,text,boolean)",
                 "list_keys(text,text,interval,boolean,integer)",
                 "maintain(timestamp with time zone)",
                 "metrics(timestamp with time zone,boolean)",
                 "metrics_by_scope(timestamp with time zone)")


@pytest.fixture
def cluster_db(citus_cluster: Any, citus_db: str) -> Iterator[str]:
    """citus_db with the migrations applied on the coordinator and distributed (4 shards)."""
    for migration in sorted(MIGRATIONS.glob("*.sql")):
        citus_cluster.coordinator.run_psql(citus_db, migration, args=MIGRATION_PSQL_ARGS)
    yield citus_db


def metrics(conn: psycopg.Connection[Any], reference_time: str | None = None) -> dict[str, Any]:
    with conn.cursor(row_factory=dict_row) as cur:
        if reference_time is None:
            return cur.execute("SELECT * FROM idempotency.metrics()").fetchone()
        return cur.execute(f"SELECT * FROM idempotency.metrics({reference_time})").fetchone()


def wait_for(conn: psycopg.Connection[Any], column: str, value: int,
              reference_time: str | None = None) -> dict[str, Any]:
    """metrics() once ``column`` reads ``value``: the workers' statistics trail the commits by
    up to a second or so (more on a busy machine)."""
    def read() -> dict[str, Any] | None:
        m = metrics(conn, reference_time)
        return m if m[column] == value else None

    return wait_until(read, f"metrics().{column} = {value}", interval=0.3)


def make_keys(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    """Per scope: two completed keys, one in progress (live lease), one released; in the first
    scope also one in progress whose lease expired HOURS_AGO hours ago less a minute."""
    def claim(scope: str, key: str, **kw: Any) -> int:
        extra = "".join(f", {k} => %({k})s" for k in kw)
        return conn.execute(
            "SELECT lease_token FROM idempotency.claim(%(scope)s, %(key)s, '{}'::jsonb"
            f"{extra})", {"scope": scope, "key": key, **kw}).fetchone()[0]

    for scope in SCOPES:
        for key in ("done1", "done2"):
            conn.execute("SELECT idempotency.complete(%s, %s, %s, 201, '{}')",
                         (scope, key, claim(scope, key)))
        claim(scope, "live", lease=timedelta(hours=1))
        conn.execute("SELECT idempotency.release(%s, 'gone', %s)",
                     (scope, claim(scope, "gone")))
    past = datetime.now(timezone.utc) - timedelta(hours=HOURS_AGO)
    claim(SCOPES[0], "dead", lease=timedelta(minutes=1), reference_time=past)
    return {"in_progress": len(SCOPES) + 1, "released": len(SCOPES),
            "completed": 2 * len(SCOPES), "total": 4 * len(SCOPES) + 1}


def test_distribute_places_the_new_tables_and_functions(citus_cluster: Any,
                                                        cluster_db: str) -> None:
    with psycopg.connect(cluster_db, autocommit=True) as conn:
        rows = conn.execute("SELECT object, action FROM idempotency.distribute(4)").fetchall()
        custom = {o for o, a in rows if a.startswith("plans each statement afresh")}
        done = {o: a for o, a in rows if not a.startswith("plans each statement afresh")}
        # Citus propagates most functions by itself when the migration creates them (the
        # workers are registered by then); distribute() creates the rest on every node. Either
        # way each one is a distributed object afterwards, none of them delegated.
        for fn in NEW_FUNCTIONS:
            assert done.get(f"idempotency.{fn}") in (None, "created on every node"), (fn, done)
        assert conn.execute(
            "SELECT p.oid::regprocedure::text FROM pg_proc AS p"
            " JOIN pg_dist_object AS o ON o.classid = 'pg_proc'::regclass AND o.objid = p.oid"
            " WHERE o.distribution_argument_index IS NULL AND p.oid = ANY (%s::regprocedure[])"
            " ORDER BY 1", ([f"idempotency.{fn}" for fn in NEW_FUNCTIONS],)
        ).fetchall() == [(f"idempotency.{fn}",) for fn in sorted(NEW_FUNCTIONS)]
        # grants and maintenance_runs stay the coordinator's own (see distribute.sql).
        assert conn.execute(
            "SELECT count(*) FROM pg_dist_partition WHERE logicalrelid IN"
            " ('idempotency.grants'::regclass, 'idempotency.maintenance_runs'::regclass)"
        ).fetchone() == (0,)
        # Custom plans for the per-key functions (see _citus_custom_plans), which the
        # migrations' last statement could not set before keys was distributed.
        assert {"idempotency.claim(text,text,jsonb,interval,bytea,boolean,timestamp with time"
                " zone)", "idempotency._resume_existing(idempotency.keys,interval,timestamp"
                " with time zone)"} <= custom, custom
        assert conn.execute("SELECT count(*) FROM idempotency.distribute()").fetchone() == (0,)
        # The shards of keys are on both workers.
        assert conn.execute(
            "SELECT count(DISTINCT nodeport) FROM citus_shards"
            " WHERE table_name = 'idempotency.keys'::regclass").fetchone() == (2,)
    dbname = conninfo_to_dict(cluster_db)["dbname"]
    for worker in citus_cluster.workers:
        with psycopg.connect(worker.dsn(dbname), autocommit=True) as wconn:
            present = [fn for fn in NEW_FUNCTIONS if wconn.execute(
                "SELECT to_regprocedure(%s) IS NOT NULL", (f"idempotency.{fn}",)).fetchone()[0]]
            assert present == list(NEW_FUNCTIONS), worker.name


def test_metrics_and_maintain_through_the_coordinator(citus_cluster: Any,
                                                      cluster_db: str) -> None:
    with psycopg.connect(cluster_db, autocommit=True) as conn:
        conn.execute("SELECT count(*) FROM idempotency.distribute(4)")
        # Before any key: zeros, not NULLs or errors, from every shard.
        empty = metrics(conn)
        assert (empty["keys_in_progress"], empty["keys_released"],
                empty["keys_total_estimate"]) == (0, 0, 0)
        assert empty["partitions_ahead"] == empty["premake"] == 3
        assert empty["total_bytes"] > 0  # the shards' indexes, on the workers
        expected = make_keys(conn)
        # The scopes land on more than one worker, so every count sums over nodes.
        nodes = conn.execute(
            "SELECT count(DISTINCT s.nodeport) FROM unnest(%s::text[]) AS t (scope)"
            " JOIN citus_shards AS s ON s.table_name = 'idempotency.keys'::regclass"
            " AND s.shardid = get_shard_id_for_distribution_column('idempotency.keys', t.scope)",
            (SCOPES,)).fetchone()[0]
        assert nodes == 2

        m = wait_for(conn, "keys_total_estimate", expected["total"])
        assert m["keys_in_progress"] == expected["in_progress"]
        assert m["keys_expired_leases"] == 1
        assert m["keys_released"] == expected["released"]
        assert m["oldest_in_progress_age_seconds"] == pytest.approx(HOURS_AGO * 3600, abs=120)
        assert m["keys_total_estimate"] == expected["total"]
        assert m["keys_completed_estimate"] == expected["completed"]
        # The default partition's estimate is its shards' too (the "dead" key lands there when
        # HOURS_AGO reaches back before today's partition).
        in_default = conn.execute("SELECT count(*) FROM idempotency.keys_default").fetchone()[0]
        assert wait_for(conn, "keys_default_estimate", in_default)["keys_default_estimate"] \
            == in_default
        assert m["total_bytes"] > empty["total_bytes"]
        by_scope = conn.execute("SELECT * FROM idempotency.metrics_by_scope()").fetchall()
        assert [(s, n, e, r) for s, n, e, _, r in by_scope] == [
            (scope, 2 if scope == SCOPES[0] else 1, 1 if scope == SCOPES[0] else 0, 1)
            for scope in SCOPES]

        # maintain() through the coordinator, recorded there.
        actions = conn.execute("SELECT action FROM idempotency.maintain()").fetchall()
        m = metrics(conn)
        assert m["maintain_last_outcome"] == "ok"
        assert m["maintain_last_created"] == actions.count(("created",))
        assert conn.execute("SELECT count(*) FROM idempotency.maintenance_runs").fetchone() == (1,)

        # Keys of three days ago (the owner's test clock), in partitions made for then: their
        # partition goes with its directory rows and the metrics follow. (A reference_time
        # ahead of the clock drops nothing younger than the retention.)
        before = conn.execute("SELECT count(*) FROM idempotency.key_directory").fetchone()[0]
        conn.execute("SELECT idempotency._premake(now() - interval '3 days')")
        for scope in SCOPES:
            conn.execute(
                "SELECT idempotency.complete(%s, 'old', c.lease_token, 201, '{}', "
                "reference_time => now() - interval '3 days') FROM idempotency.claim(%s, "
                "'old', '{}', reference_time => now() - interval '3 days') AS c",
                (scope, scope))
        actions = conn.execute(
            "SELECT action, parent_table FROM idempotency.maintain()").fetchall()
        dropped = [a for a in actions if a == ("dropped", "keys")]
        assert dropped, actions
        m = wait_for(conn, "keys_total_estimate", expected["total"])
        assert (m["keys_in_progress"], m["keys_released"], m["keys_total_estimate"]) == (
            expected["in_progress"], expected["released"], expected["total"])
        assert m["maintain_last_outcome"] == "ok"
        assert m["maintain_last_dropped"] == sum(1 for a, _ in actions if a == "dropped")
        assert conn.execute("SELECT count(*) FROM idempotency.key_directory").fetchone() == (
            before,)
        assert conn.execute("SELECT outcome FROM idempotency.maintenance_runs ORDER BY id"
                            ).fetchall() == [("ok",), ("ok",)]


def test_keys_and_a_monitor_role_through_the_coordinator(citus_cluster: Any,
                                                         cluster_db: str) -> None:
    scope = SCOPES[3]
    with psycopg.connect(cluster_db, autocommit=True) as conn:
        conn.execute("SELECT count(*) FROM idempotency.distribute(4)")
        token = conn.execute("SELECT lease_token FROM idempotency.claim(%s, 'stuck', '{}',"
                             " lease => '1 hour')", (scope,)).fetchone()[0]
        shown = conn.execute("SELECT state, lease_expired, partition_name FROM"
                             " idempotency.inspect_key(%s, 'stuck')", (scope,)).fetchone()
        assert shown[:2] == ("in_progress", False) and shown[2].startswith("idempotency.keys_")
        conn.execute("SELECT idempotency.force_release(%s, 'stuck')", (scope,))
        assert conn.execute("SELECT state FROM idempotency.inspect_key(%s, 'stuck')",
                            (scope,)).fetchone() == ("released",)
        with pytest.raises(psycopg.Error) as info:
            conn.execute("SELECT idempotency.heartbeat(%s, 'stuck', %s)", (scope, token))
        assert info.value.sqlstate == "IK001"
        outcome, new_token = conn.execute(
            "SELECT outcome, lease_token FROM idempotency.claim(%s, 'stuck', '{}')",
            (scope,)).fetchone()
        assert outcome == "claimed" and new_token > token

        role = f"monitor_{uuid.uuid4().hex[:8]}"
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        conn.execute("SELECT idempotency.grant_usage(%s::regrole, kind => 'monitor')", (role,))
    try:
        with psycopg.connect(cluster_db, user=role, autocommit=True) as mon:
            m = wait_for(mon, "keys_total_estimate", 1)
            assert (m["keys_in_progress"], m["keys_released"], m["keys_total_estimate"]) \
                == (1, 0, 1)
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                mon.execute("SELECT * FROM idempotency.inspect_key(%s, 'stuck')", (scope,))
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                mon.execute("SELECT idempotency.force_release(%s, 'stuck')", (scope,))
    finally:
        with psycopg.connect(cluster_db, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_upgrade_of_a_distributed_install(citus_cluster: Any, citus_db: str) -> None:
    """0.9.0 distributed, then 0010 and 0011 applied on the coordinator and distribute() run
    again, as docs/scale-out.md ("Upgrading") says: a key released under 0.9.0 is claimed afresh
    through the coordinator (claim now calls _drop_released_row, new in 0010, on the worker)
    with a greater token, metrics() counts across the workers, nothing was lost, and 0011's
    local halves are generated on every worker."""
    coordinator = citus_cluster.coordinator
    files = sorted(MIGRATIONS.glob("*.sql"))
    old = [f for f in files if int(f.name[:4]) <= 9]
    new = [f for f in files if int(f.name[:4]) > 9]
    assert old and new
    for migration in old:
        coordinator.run_psql(citus_db, migration, args=MIGRATION_PSQL_ARGS)
    with psycopg.connect(citus_db, autocommit=True) as conn:
        conn.execute("SELECT count(*) FROM idempotency.distribute(4)")
        tokens = {}
        for scope in SCOPES:
            tokens[scope] = conn.execute(
                "SELECT lease_token FROM idempotency.claim(%s, 'k', '{}')", (scope,)).fetchone()[0]
            conn.execute("SELECT idempotency.release(%s, 'k', %s)", (scope, tokens[scope]))
        conn.execute("SELECT lease_token FROM idempotency.claim('kept', 'k', '{}')")
    for migration in new:
        coordinator.run_psql(citus_db, migration, args=MIGRATION_PSQL_ARGS)
    # The migrations alone (before distribute() again) leave the per-key functions with custom
    # plans on every node: with the sources' generic plans, Citus's local plan cache would grow
    # a worker's sessions with every call (see _citus_custom_plans).
    for node in citus_cluster.nodes:
        with psycopg.connect(node.dsn(citus_db.rsplit("/", 1)[1]), autocommit=True) as conn:
            assert dict(conn.execute(
                "SELECT p.proname::text, p.proconfig[2] FROM pg_proc AS p"
                " WHERE p.pronamespace = 'idempotency'::regnamespace"
                " AND p.proname IN ('claim', 'complete', 'release', '_resume_existing')"
            ).fetchall()) == dict.fromkeys(
                ["claim", "complete", "release", "_resume_existing"],
                "plan_cache_mode=force_custom_plan"), node.name
    delegated = ("SELECT count(*) FROM pg_dist_object WHERE classid = 'pg_proc'::regclass"
                 " AND objid = 'idempotency.claim'::regproc AND distribution_argument_index = 0")
    with psycopg.connect(citus_db, autocommit=True) as conn:
        # 0.9.0's distribute() delegated claim; the migrations leave that as it is ...
        assert conn.execute(delegated).fetchone() == (1,)
        again = dict(conn.execute("SELECT object, action FROM idempotency.distribute()").fetchall())
        # ... and distribute() without delegate => true undoes it (docs/scale-out.md).
        assert conn.execute(delegated).fetchone() == (0,)
        assert again[conn.execute("SELECT 'idempotency.claim'::regproc::regprocedure::text"
                                  ).fetchone()[0]] == "no longer delegated"
        assert "idempotency.keys" not in again  # tables stay as they were distributed
        assert not [a for a in again.values() if a.startswith("plans each")], again
        version = conn.execute("SELECT max(version) FROM idempotency.migrations").fetchone()[0]
        assert version == max(int(f.name[:4]) for f in files)
        for scope in SCOPES:
            outcome, token = conn.execute(
                "SELECT outcome, lease_token FROM idempotency.claim(%s, 'k', '{\"n\": 2}')",
                (scope,)).fetchone()
            assert outcome == "claimed" and token > tokens[scope], scope
        assert conn.execute("SELECT state, count(*) FROM idempotency.keys GROUP BY state"
                            ).fetchall() == [("in_progress", len(SCOPES) + 1)]
        assert metrics(conn)["keys_in_progress"] == len(SCOPES) + 1
    for worker in citus_cluster.workers:
        with psycopg.connect(worker.dsn(citus_db.rsplit("/", 1)[1]), autocommit=True) as conn:
            assert conn.execute("SELECT to_regprocedure('idempotency._drop_released_row("
                                "text, text, timestamptz, bigint)') IS NOT NULL").fetchone()[0]
            # 0011's local halves are in place on an upgraded cluster too (docs/design.md).
            assert conn.execute("SELECT idempotency._local_shards()").fetchone() == (True,)
            assert conn.execute(
                "SELECT count(*) FROM pg_proc WHERE proname IN ('_claim_row_local',"
                " '_complete_row_local') AND prosrc LIKE '%lock_shard_metadata%'"
                " AND proconfig = '{plan_cache_mode=force_generic_plan}'").fetchone() == (2,)


# -- issue 33: what a worker serves and what it refuses ----------------------------------------

#: Every function that only the coordinator can serve, and why (docs/scale-out.md, "On a
#: worker"): on a worker each answers IK022 and changes nothing.
COORDINATOR_ONLY = {
    "distribute": "SELECT * FROM idempotency.distribute()",
    "maintain": "SELECT * FROM idempotency.maintain()",
    "schedule_maintenance": "SELECT idempotency.schedule_maintenance('*/10 * * * *')",
    "unschedule_maintenance": "SELECT idempotency.unschedule_maintenance()",
    "metrics": "SELECT * FROM idempotency.metrics()",
    "metrics_by_scope": "SELECT * FROM idempotency.metrics_by_scope()",
    "key_status": "SELECT * FROM idempotency.key_status()",
    "partition_status": "SELECT * FROM idempotency.partition_status()",
    "grant_usage": "SELECT idempotency.grant_usage(%(role)s::regrole, kind => 'request')",
}
#: What the monitor kind may call: refused on a worker for that role too.
MONITOR_CALLS = ("metrics", "metrics_by_scope")


def _state(conn: psycopg.Connection[Any], role: str) -> tuple[Any, ...]:
    """What any of COORDINATOR_ONLY could change, read on one node."""
    return (
        conn.execute("SELECT count(*) FROM pg_inherits WHERE inhparent IN"
                     " ('idempotency.keys'::regclass, 'idempotency.inbox'::regclass,"
                     " 'idempotency.tombstones'::regclass)").fetchone(),
        conn.execute("SELECT count(*) FROM pg_dist_partition").fetchone(),
        conn.execute("SELECT has_schema_privilege(%s, 'idempotency', 'USAGE'),"
                     " has_function_privilege(%s, 'idempotency.claim(text, text, jsonb,"
                     " interval, bytea, boolean, timestamptz)', 'EXECUTE')",
                     (role, role)).fetchone(),
        conn.execute("SELECT to_regnamespace('cron') IS NULL").fetchone(),
        conn.execute("SELECT state, count(*) FROM idempotency.keys GROUP BY 1 ORDER BY 1"
                     ).fetchall(),
    )


def test_coordinator_only_functions_answer_ik022_on_every_worker(citus_cluster: Any,
                                                                 cluster_db: str) -> None:
    """Each coordinator-only function, called on each worker by the role that may call it (the
    schema owner; the monitor role for the metrics), raises IK022 naming itself with the hint
    to run it on the coordinator, and nothing changes on any node: partitions, distributed
    tables, grants, pg_cron, keys, maintenance_runs."""
    dbname = conninfo_to_dict(cluster_db)["dbname"]
    role = f"app_{uuid.uuid4().hex[:8]}"
    monitor = f"monitor_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(cluster_db, autocommit=True) as conn:
        conn.execute("SELECT count(*) FROM idempotency.distribute(4)")
        make_keys(conn)
        for name in (role, monitor):
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
        conn.execute("SELECT idempotency.grant_usage(%s::regrole, kind => 'monitor')",
                     (monitor,))
        runs = conn.execute("SELECT count(*) FROM idempotency.maintenance_runs").fetchone()
        grants = conn.execute("SELECT count(*) FROM idempotency.grants").fetchone()
    try:
        before = {}
        for node in citus_cluster.nodes:
            with psycopg.connect(node.dsn(dbname), autocommit=True) as conn:
                before[node.name] = _state(conn, role)
        for worker in citus_cluster.workers:
            calls = [(fn, None) for fn in COORDINATOR_ONLY] + [(fn, monitor)
                                                               for fn in MONITOR_CALLS]
            for fn, user in calls:
                kw = {"user": user} if user else {}
                with psycopg.connect(worker.dsn(dbname, **kw), autocommit=True) as conn:
                    with pytest.raises(psycopg.Error) as info:
                        conn.execute(COORDINATOR_ONLY[fn], {"role": role})
                exc = info.value
                assert exc.sqlstate == "IK022", (worker.name, fn, user, exc.sqlstate, str(exc))
                assert exc.diag.message_primary == (
                    f"idempotency.{fn}: this node is not the Citus coordinator"), exc
                assert (exc.diag.message_hint or "").startswith("Run it on the coordinator ("), exc
                if fn != "distribute":  # its own words, from before _require_coordinator
                    assert (exc.diag.message_detail or "").startswith(
                        "This is a worker (Citus group"), exc
        for node in citus_cluster.nodes:
            with psycopg.connect(node.dsn(dbname), autocommit=True) as conn:
                assert _state(conn, role) == before[node.name], node.name
        with psycopg.connect(cluster_db, autocommit=True) as conn:
            assert conn.execute("SELECT count(*) FROM idempotency.maintenance_runs"
                                ).fetchone() == runs
            assert conn.execute("SELECT count(*) FROM idempotency.grants").fetchone() == grants
            # The same calls on the coordinator work (pg_cron is not installed: IK020 there).
            conn.execute(COORDINATOR_ONLY["grant_usage"], {"role": role})
            assert conn.execute("SELECT count(*) FROM idempotency.grants").fetchone() \
                == (grants[0] + 1,)
            for fn in ("schedule_maintenance", "unschedule_maintenance"):
                with pytest.raises(psycopg.Error) as info:
                    conn.execute(COORDINATOR_ONLY[fn])
                assert info.value.sqlstate == "IK020", fn
    finally:
        with psycopg.connect(cluster_db, autocommit=True) as conn:
            for name in (role, monitor):
                conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
                conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def test_operator_functions_for_keys_work_on_a_worker(citus_cluster: Any,
                                                      cluster_db: str) -> None:
    """The operator functions that read or change keys through Citus's routing are not
    coordinator-only: on a worker of the metadata-synced cluster inspect_key, list_keys and
    list_abandoned answer what they answer on the coordinator (a key of either worker), and
    force_release on a worker releases a key the coordinator then sees released."""
    dbname = conninfo_to_dict(cluster_db)["dbname"]
    with psycopg.connect(cluster_db, autocommit=True) as conn:
        conn.execute("SELECT count(*) FROM idempotency.distribute(4)")
        make_keys(conn)
        queries = [
            ("SELECT * FROM idempotency.inspect_key(%s, 'done1')", (SCOPES[5],)),
            ("SELECT * FROM idempotency.list_keys() ORDER BY scope, key", None),
            ("SELECT * FROM idempotency.list_keys(scope => %s, state => 'in_progress')",
             (SCOPES[0],)),
            ("SELECT scope, key FROM idempotency.list_abandoned() ORDER BY 1, 2", None),
        ]
        expected = [conn.execute(q, p).fetchall() for q, p in queries]
        assert expected[0] and len(expected[1]) == 4 * len(SCOPES) + 1
        assert expected[3] == [(SCOPES[0], "dead")]
    for worker in citus_cluster.workers:
        with psycopg.connect(worker.dsn(dbname)) as conn:
            for (q, p), want in zip(queries, expected, strict=True):
                assert conn.execute(q, p).fetchall() == want, (worker.name, q)
                conn.rollback()  # list_abandoned keeps its rows locked until the end
    for i, worker in enumerate(citus_cluster.workers):
        with psycopg.connect(worker.dsn(dbname), autocommit=True) as conn:
            conn.execute("SELECT idempotency.force_release(%s, 'live')", (SCOPES[i],))
    with psycopg.connect(cluster_db, autocommit=True) as conn:
        assert conn.execute(
            "SELECT scope, state FROM idempotency.keys WHERE key = 'live' ORDER BY scope"
        ).fetchall() == [(s, "released" if s in SCOPES[:2] else "in_progress")
                         for s in SCOPES]
