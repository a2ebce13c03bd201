"""The engine on a real Citus cluster (a coordinator and two workers, harness/citus_cluster.py),
installed as docs/scale-out.md says: the migrations on the coordinator, then
``SELECT idempotency.distribute()``.

What is checked, through the coordinator and straight on the workers:
- one owner per key however a claim arrives (delegated, not delegated, on a worker), with real
  concurrent sessions;
- tokens that grow with every owner of a key (takeovers, release, a shard move) and that a
  caller cannot guess, and one answer for every wrong token (no oracle);
- a co-located business insert commits or rolls back with complete() on one worker;
- maintenance, status and roles through the coordinator, and a shard move under load;
- every conformance scenario, in all six runners, through the coordinator.
"""

from __future__ import annotations

import copy
import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers import MIGRATION_PSQL_ARGS, MIGRATIONS, sqlstate
from helpers.citus import Cluster, installed
from psycopg import sql

import conformance as conf
import pg_idempotency as idem
from conformance import langs, psqlrunner, pyrunner
from pg_idempotency import aio
from pg_idempotency.errors import from_psycopg
from pgharness import WAIT_BOUND, wait_until

API = conf.load_api()
FILES = conf.scenario_files()
IDS = [p.stem for p in FILES]


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def citus(citus_cluster: Any) -> Iterator[Cluster]:
    # Eight shards: enough for two nodes and a move, fewer than the default 32 to keep the
    # cluster quick on two cores.
    yield installed(citus_cluster, "idem_citus", 8)


def _scope() -> str:
    return f"tenant_{uuid.uuid4().hex[:10]}"


def _claim(dsn: str, scope: str, key: str, request: str = "{}", **kw: Any) -> tuple[Any, ...]:
    extra = "".join(f", {k} => %({k})s" for k in kw)
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(
            "SELECT outcome, lease_token, attempts FROM idempotency.claim("
            f"%(scope)s, %(key)s, %(request)s::jsonb{extra})",
            {"scope": scope, "key": key, "request": request, **kw}).fetchone()


# -- the install -------------------------------------------------------------------------------

def test_distribute_twice_changes_nothing_and_places_the_tables(citus: Cluster) -> None:
    with psycopg.connect(citus.dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM idempotency.distribute(delegate => true)"
                            ).fetchone() == (0,)
        tables = dict(conn.execute(
            "SELECT logicalrelid::regclass::text, partmethod FROM pg_dist_partition"
            " WHERE logicalrelid::regclass::text IN ('idempotency.keys',"
            " 'idempotency.key_directory', 'idempotency.tombstones', 'idempotency.inbox',"
            " 'idempotency.settings', 'idempotency.migrations')").fetchall())
        assert tables == {"idempotency.keys": "h", "idempotency.key_directory": "h",
                          "idempotency.tombstones": "h", "idempotency.inbox": "h",
                          "idempotency.settings": "n", "idempotency.migrations": "n"}
        groups = conn.execute(
            "SELECT count(DISTINCT colocationid) FROM pg_dist_partition WHERE logicalrelid IN"
            " ('idempotency.keys'::regclass, 'idempotency.key_directory'::regclass,"
            " 'idempotency.tombstones'::regclass, 'idempotency.inbox'::regclass)").fetchone()
        assert groups == (1,)
        delegated = dict(conn.execute(
            "SELECT p.proname::text, o.force_delegation FROM pg_dist_object AS o"
            " JOIN pg_proc AS p ON p.oid = o.objid WHERE o.classid = 'pg_proc'::regclass"
            " AND o.distribution_argument_index IS NOT NULL").fetchall())
        assert delegated == dict.fromkeys(
            ["claim", "complete", "complete_bytes", "heartbeat", "checkpoint", "accept",
             "release", "takeover", "inbox_accept", "heartbeat_outcome", "checkpoint_outcome",
             "release_outcome"], True)
        # The routes have no per-partition branches: statements go to the scope's shard.
        src = conn.execute("SELECT prosrc FROM pg_proc WHERE proname = '_complete_row'"
                           " AND pronamespace = 'idempotency'::regnamespace").fetchone()[0]
        assert "to_regclass" not in src and "UPDATE idempotency.keys AS k" in src
    # Custom plans on every node for every function that runs per-key statements (see
    # _citus_custom_plans); the routes take their caller's.
    custom = {"claim", "complete", "complete_bytes", "heartbeat", "checkpoint", "accept",
              "release", "takeover", "inbox_accept", "_resume_existing", "_lease_outcome",
              "heartbeat_outcome", "checkpoint_outcome", "release_outcome",
              "key_status", "inspect_key", "force_release", "list_keys", "list_abandoned"}
    routes = {"_key_row", "_complete_row", "_heartbeat_row", "_checkpoint_row", "_accept_row",
              "_release_row", "_drop_released_row", "_resume_row"}
    for dsn in [citus.dsn, *citus.worker_dsns()]:
        with psycopg.connect(dsn, autocommit=True) as conn:
            modes = dict(conn.execute(
                "SELECT p.proname::text, coalesce(array_to_string(p.proconfig, ' '), '')"
                " FROM pg_proc AS p WHERE p.pronamespace = 'idempotency'::regnamespace"
                " AND p.proname = ANY (%s)", (sorted(custom | routes),)).fetchall())
        assert {f for f, m in modes.items() if "plan_cache_mode=force_custom_plan" in m} \
            == custom, dsn
        assert {f: m for f, m in modes.items() if f in routes} == dict.fromkeys(routes, ""), dsn


DELEGATED = ["accept", "checkpoint", "checkpoint_outcome", "claim", "complete", "complete_bytes",
             "heartbeat", "heartbeat_outcome", "inbox_accept", "release", "release_outcome",
             "takeover"]


def _delegated(cluster: Cluster) -> list[list[str]]:
    """The functions delegated by their first argument, as each node's metadata says
    (coordinator first)."""
    out = []
    for dsn in [cluster.dsn, *cluster.worker_dsns()]:
        with psycopg.connect(dsn, autocommit=True) as conn:
            out.append([name for (name,) in conn.execute(
                "SELECT p.proname::text FROM pg_dist_object AS o JOIN pg_proc AS p"
                " ON p.oid = o.objid WHERE o.classid = 'pg_proc'::regclass"
                " AND o.distribution_argument_index = 0 AND o.force_delegation"
                " ORDER BY 1").fetchall()])
    return out


def test_distribute_delegates_only_when_asked_and_undoes_it(citus_cluster: Any) -> None:
    """distribute() with no options delegates nothing (a stock Citus crashes on some SQL around
    a delegated call, docs/scale-out.md): every function is on every node and a top-level call
    through the coordinator runs its body there, each statement sent to the scope's worker.
    delegate => true delegates the per-key functions on every node; delegate => false (the
    default, so distribute() after a migration too) undoes it everywhere."""
    c = installed(citus_cluster, "idem_modes", 4, delegate=False)
    assert _delegated(c) == [[], [], []]
    scope = _scope()
    with psycopg.connect(c.dsn, autocommit=True) as conn:
        notices: list[str] = []
        conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
        conn.execute("SET citus.log_remote_commands = on")
        conn.execute("SET client_min_messages = log")
        assert conn.execute("SELECT outcome FROM idempotency.claim(%s, 'k', '{}')",
                            (scope,)).fetchone() == ("claimed",)
        sent = [n for n in notices if n.startswith("issuing")]
        conn.execute("RESET client_min_messages")
        assert sent and not [n for n in sent if "idempotency.claim(" in n], sent
        assert [n for n in sent if "idempotency.key_directory" in n], sent
        rows = conn.execute("SELECT object, action FROM idempotency.distribute(delegate => true)"
                            ).fetchall()
        assert sorted(o.split("(")[0] for o, a in rows if a.startswith("delegated by ")) == [
            f"idempotency.{f}" for f in DELEGATED]
        assert _delegated(c) == [DELEGATED] * 3
        role = f"request_{uuid.uuid4().hex[:6]}"
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        conn.execute("SELECT idempotency.grant_usage(%s::regrole, kind => 'request')", (role,))
        comment = "SELECT obj_description('idempotency.claim'::regproc, 'pg_proc')"
        before = conn.execute(comment).fetchone()
        rows = conn.execute("SELECT object, action FROM idempotency.distribute()").fetchall()
        assert sorted(o.split("(")[0] for o, a in rows if a == "no longer delegated") == [
            f"idempotency.{f}" for f in DELEGATED]
        assert conn.execute(comment).fetchone() == before
        assert conn.execute("SELECT count(*) FROM idempotency.distribute()").fetchone() == (0,)
        with pytest.raises(psycopg.Error) as info:
            conn.execute("SELECT idempotency.distribute(delegate => NULL)")
        assert info.value.sqlstate == "IK014"
    assert _delegated(c) == [[], [], []]
    # Undoing it recreated the functions on every node: the request role may still call them
    # there, and PUBLIC still may not.
    for i, node in enumerate(c.cluster.nodes):
        with psycopg.connect(node.dsn(c.db, user=role), autocommit=True) as conn:
            assert conn.execute("SELECT outcome FROM idempotency.claim(%s, 'k', '{}')",
                                (f"{scope}_{i}",)).fetchone() == ("claimed",)
        with psycopg.connect(node.dsn(c.db), autocommit=True) as conn:
            assert conn.execute("SELECT has_function_privilege('public', 'idempotency.claim("
                                "text, text, jsonb, interval, bytea, boolean, timestamptz)',"
                                " 'EXECUTE')").fetchone() == (False,)
    c.cluster.drop_database(c.db)


def test_per_key_calls_run_on_one_worker_in_one_hop(citus: Cluster) -> None:
    """The coordinator sends each per-key call as one command to the scope's worker."""
    scope = _scope()
    node = citus.node_of(scope)
    with psycopg.connect(citus.dsn, autocommit=True) as conn:
        notices: list[str] = []
        conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
        conn.execute("SET citus.log_remote_commands = on")
        conn.execute("SET client_min_messages = log")
        token = conn.execute("SELECT lease_token FROM idempotency.claim(%s, 'k', '{}')",
                             (scope,)).fetchone()[0]
        claim_cmds = [n for n in notices if n.startswith("issuing")]
        notices.clear()
        conn.execute(idem.queries.COMPLETE, {
            "scope": scope, "key": "k", "lease_token": token, "status": 201, "body": "{}",
            "headers": "{}", "reference_time": None})
        complete_cmds = [n for n in notices if n.startswith("issuing")]
    assert len(claim_cmds) == 1 and "idempotency.claim(" in claim_cmds[0], claim_cmds
    assert len(complete_cmds) == 1 and "idempotency.complete(" in complete_cmds[0], complete_cmds
    with psycopg.connect(node, autocommit=True) as conn:
        assert conn.execute("SELECT state FROM idempotency.keys WHERE scope = %s",
                            (scope,)).fetchone() == ("completed",)


@pytest.mark.parametrize("datestyle", ["ISO, MDY", "SQL, DMY"])
def test_the_packages_own_sends_run_on_one_worker_in_one_hop(citus: Cluster, datestyle: str
                                                             ) -> None:
    """operation()'s claim (queries.CLAIM_SHORT, in the select list) and complete + COMMIT (the
    short form under DateStyle ISO, the epoch form under another) each reach the scope's
    worker as one command with the call: delegated, no statement of the bodies run from the
    coordinator."""
    scope = _scope()
    with psycopg.connect(citus.dsn, autocommit=True,
                         options=f"-c DateStyle={datestyle.replace(' ', '')}") as conn:
        notices: list[str] = []
        conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
        conn.execute("SET citus.log_remote_commands = on")
        conn.execute("SET client_min_messages = log")
        notices.clear()
        with idem.operation(conn, scope, "k", {"a": 1}) as op:
            claim_cmds = [n for n in notices if n.startswith("issuing")]
            notices.clear()
            stored = op.complete(201, {"b": 2})
        complete_cmds = [n for n in notices if n.startswith("issuing")]
    assert len(claim_cmds) == 1 and "idempotency.claim(" in claim_cmds[0], claim_cmds
    calls = [c for c in complete_cmds if "idempotency.complete_bytes(" in c]
    assert len(calls) == 1, complete_cmds
    assert not [c for c in claim_cmds + complete_cmds
                if "idempotency.keys" in c or "key_directory" in c], complete_cmds
    with psycopg.connect(citus.node_of(scope), autocommit=True) as conn:
        assert conn.execute("SELECT state, completed_at FROM idempotency.keys WHERE scope = %s",
                            (scope,), binary=True).fetchone() == ("completed", stored.completed_at)


def test_a_session_does_not_grow_with_every_call(citus: Cluster) -> None:
    """Citus 13.2.2 and 14.0.1 keep a new local plan for every execution of a cached generic
    plan whose shard is pruned at run time (citusdata/citus#8824): a PL/pgSQL statement by
    scope, run on the node that holds the shard, grew its session by about 200 kB per
    claim + complete, until the server ran out of memory. distribute() makes the per-key
    functions plan each statement afresh on a cluster; this measures a session on the worker
    that holds the scope (where a delegated body runs), call after call."""
    scope = _scope()
    with psycopg.connect(citus.node_of(scope), autocommit=True) as conn:
        def pairs(n: int, start: int) -> None:
            for i in range(start, start + n):
                token = conn.execute(idem.queries.CLAIM, {
                    "scope": scope, "key": f"k{i}", "request": '{"a": 1}', "lease": "30 s",
                    "fingerprint": None, "strict": False,
                    "reference_time": None}).fetchone()[1]
                assert token is not None
                conn.execute(idem.queries.COMPLETE, {
                    "scope": scope, "key": f"k{i}", "lease_token": token, "status": 201,
                    "body": "{}", "headers": "{}", "reference_time": None})

        def used() -> int:
            return conn.execute(
                "SELECT sum(total_bytes - free_bytes) FROM pg_backend_memory_contexts"
            ).fetchone()[0]

        pairs(30, 0)  # every plan made, cached and used once
        before = used()
        pairs(300, 30)
        grown = used() - before
        assert conn.execute("SELECT count(*) FROM idempotency.keys WHERE scope = %s"
                            " AND state = 'completed'", (scope,)).fetchone() == (330,)
        modes = dict(conn.execute(
            "SELECT p.proname::text, p.proconfig FROM pg_proc AS p"
            " WHERE p.pronamespace = 'idempotency'::regnamespace"
            " AND p.proname IN ('claim', 'complete')").fetchall())
    # 300 pairs leaked about 60 MB; a session's plans and caches stay well under 1 MB after
    # warming up.
    assert grown < 2 * 1024 * 1024, f"the session grew by {grown} bytes over 300 pairs"
    assert all("plan_cache_mode=force_custom_plan" in (cfg or []) for cfg in modes.values()), \
        modes


def test_complete_guesses_the_hour_and_falls_back_to_the_directory(citus: Cluster) -> None:
    """On a cluster the routes have no partition branches; complete() first looks for a key
    created in the hour before its own time, without reading key_directory (a statement through
    Citus's executor like any other), and reads the directory only when that misses: a key
    claimed two hours ago. Same answers either way: IK001 for a stale token, IK004 for a second
    completion. Measured on the worker that holds the scope, where a delegated body runs."""
    scope = _scope()
    directory_locks = (
        "SELECT count(*) FROM pg_locks AS l JOIN pg_class AS c ON c.oid = l.relation"
        " WHERE l.pid = pg_backend_pid() AND c.relname LIKE 'key\\_directory%'")
    with psycopg.connect(citus.node_of(scope)) as conn:
        fresh = conn.execute("SELECT lease_token FROM idempotency.claim(%s, 'now', '{}')",
                             (scope,)).fetchone()[0]
        old = conn.execute("SELECT lease_token FROM idempotency.claim(%s, 'old', '{}', "
                           "reference_time => clock_timestamp() - interval '2 hours')",
                           (scope,)).fetchone()[0]
        conn.commit()
        assert conn.execute("SELECT idempotency.complete(%s, 'now', %s, 201, '{}') IS NOT NULL",
                            (scope, fresh)).fetchone()[0] is True
        assert conn.execute(directory_locks).fetchone()[0] == 0
        conn.commit()
        with pytest.raises(psycopg.Error) as info:
            conn.execute("SELECT idempotency.complete(%s, 'old', %s, 201, '{}')",
                         (scope, old - 1))
        assert info.value.sqlstate == "IK001"
        conn.rollback()
        assert conn.execute("SELECT idempotency.complete(%s, 'old', %s, 200, '{}') IS NOT NULL",
                            (scope, old)).fetchone()[0] is True
        assert conn.execute(directory_locks).fetchone()[0] > 0
        conn.commit()
        for key, token in (("now", fresh), ("old", old)):
            with pytest.raises(psycopg.Error) as info:
                conn.execute("SELECT idempotency.complete(%s, %s, %s, 201, '{}')",
                             (scope, key, token))
            assert info.value.sqlstate == "IK004", key
            conn.rollback()
        assert conn.execute(
            "SELECT key, state, response_status FROM idempotency.keys WHERE scope = %s"
            " ORDER BY key", (scope,)).fetchall() == [("now", "completed", 201),
                                                     ("old", "completed", 200)]


LOCAL = ("SELECT idempotency._complete_row_local(%s, %s, %s, 201, '{}', '{\"ok\": 1}', NULL,"
         " 'application/json', clock_timestamp())")
LOCAL_CLAIM = ("SELECT outcome FROM idempotency._claim_row_local(%s, %s, sha256('x'), '30 s',"
               " clock_timestamp())")


def test_complete_guesses_only_in_the_partition_of_its_own_time(citus: Cluster) -> None:
    """On a cluster complete()'s guess looks for the key in the hour up to the completion's time
    and only in the partition holding that time: ten minutes into a partition the hour reaches
    back into the previous one (here the default partition), which the guess scanned too before
    (every complete() in the first hour of a day paid for two index scans). Counted with
    pg_stat_xact_user_tables on the worker holding the scope, for the local half; the route's
    guess through Citus has the same test of created_at."""
    scope = _scope()
    shard = citus.shard_of(scope)[0]
    with psycopg.connect(citus.node_of(scope)) as conn:
        conn.execute("SET citus.override_table_visibility = off")  # shards hide in pg_class
        conn.commit()
        start = conn.execute(
            "SELECT idempotency._partition_start(s.partition_interval, clock_timestamp())"
            " FROM idempotency.settings AS s").fetchone()[0]
        scanned = ("SELECT c.relname FROM pg_stat_xact_user_tables AS t"
                   " JOIN pg_inherits AS i ON i.inhrelid = t.relid"
                   " JOIN pg_class AS c ON c.oid = t.relid"
                   " WHERE i.inhparent = %s::regclass AND t.idx_scan + t.seq_scan > 0")
        # Ten minutes in (the hour reaches back), and ninety (it does not).
        for minutes in (10, 90):
            at = start + timedelta(minutes=minutes)
            assert conn.execute(LOCAL.replace("clock_timestamp()", "%s"),
                                (scope, "absent", 1, at)).fetchone() == (None,)
            names = [r[0] for r in conn.execute(scanned, (f"idempotency.keys_{shard}",))]
            conn.rollback()
            assert len(names) == 1 and not names[0].startswith("keys_default"), (minutes, names)
        local, route = (conn.execute("SELECT prosrc FROM pg_proc WHERE proname = %s",
                                     (name,)).fetchone()[0]
                        for name in ("_complete_row_local", "_complete_row"))
    window = [line.strip() for line in local.splitlines() if "date_bin" in line]
    # The origin as a literal, not a call of _partition_start/_partition_origin: with constant
    # arguments the planner would run a SQL function on every call (custom plans).
    assert "timestamptz '2000-01-01 00:00:00+00')" in local and "_partition_" not in local
    assert window and all(line.replace("_complete_row_local.", "_complete_row.") in route
                          for line in window)


def test_claim_and_complete_write_the_local_shard_only_while_the_shard_is_there(
        citus_cluster: Any) -> None:
    """On a cluster claim()'s two INSERTs of a new key and complete()'s guess first run as
    static statements on the scope's own shards (_claim_row_local, _complete_row_local: generic
    plans), under the lock Citus's executor takes before it writes to a shard, when the node
    running them holds that shard. On the other worker, on the coordinator, with local
    execution off, under REPEATABLE READ and for a replicated shard they answer NULL and write
    nothing; a block_writes move of the shard waits for a transaction that completed
    a key there, carries that completion, and afterwards the node it left answers NULL (its
    copy of the shard stays until Citus drops it); after a split they leave the work to Citus
    until maintain() gives the new shards their branches. Its own database: the shards move
    and split."""
    c = installed(citus_cluster, "idem_local", 4)
    for node in c.cluster.nodes:
        with psycopg.connect(node.dsn(c.db), autocommit=True) as conn:
            assert conn.execute("SELECT idempotency._local_shards()").fetchone() == (True,)
    scope = _scope()
    tokens = {k: _claim(c.dsn, scope, k)[1] for k in ("k1", "k2", "k3", "k4")}
    home = c.node_of(scope)
    (away,) = [d for d in c.worker_dsns() if d != home]

    def state(key: str) -> tuple[str, int | None]:
        with psycopg.connect(c.dsn, autocommit=True) as conn:
            return conn.execute("SELECT state, response_status FROM idempotency.keys"
                                " WHERE scope = %s AND key = %s", (scope, key)).fetchone()

    def rows(key: str) -> tuple[int, int]:
        with psycopg.connect(c.dsn, autocommit=True) as conn:
            return conn.execute(
                "SELECT (SELECT count(*) FROM idempotency.keys"
                "        WHERE scope = %(s)s AND key = %(k)s),"
                " (SELECT count(*) FROM idempotency.key_directory WHERE scope = %(s)s"
                "  AND key_hash = sha256(convert_to(%(k)s, 'UTF8')))",
                {"s": scope, "k": key}).fetchone()

    for dsn in (away, c.dsn):
        with psycopg.connect(dsn, autocommit=True) as conn:
            assert conn.execute(LOCAL, (scope, "k1", tokens["k1"])).fetchone() == (None,)
            assert conn.execute(LOCAL_CLAIM, (scope, "c1")).fetchone() == (None,)
    assert rows("c1") == (0, 0)
    with psycopg.connect(home, autocommit=True) as conn:
        assert conn.execute(LOCAL_CLAIM, (scope, "c1")).fetchone() == ("claimed",)
        assert conn.execute(LOCAL_CLAIM, (scope, "c1")).fetchone() == (None,)  # taken
    assert rows("c1") == (1, 1)
    assert _claim(c.dsn, scope, "c1")[0] == "mismatch"  # sha256('x') is no request's
    # A stale token matches nothing here either.
    with psycopg.connect(home, autocommit=True) as conn:
        assert conn.execute(LOCAL, (scope, "k1", tokens["k1"] - 1)).fetchone() == (None,)
        conn.execute("SET citus.enable_local_execution = off")
        assert conn.execute(LOCAL, (scope, "k1", tokens["k1"])).fetchone() == (None,)
    # Under REPEATABLE READ the placement read would use the transaction's first snapshot,
    # blind to a move that committed while the lock waited: left to Citus.
    with psycopg.connect(home) as conn:
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        assert conn.execute(LOCAL, (scope, "k1", tokens["k1"])).fetchone() == (None,)
        conn.rollback()
    # A shard with a second placement (a replicated shard) is left to Citus, which writes
    # every copy: the row is added in a transaction that rolls back.
    with psycopg.connect(home) as conn:
        conn.execute(
            "INSERT INTO pg_dist_placement (placementid, shardid, shardstate, shardlength,"
            " groupid) SELECT 999999, get_shard_id_for_distribution_column("
            "'idempotency.keys', %s::text), 1, 0, max(groupid) + 1 FROM pg_dist_node", (scope,))
        assert conn.execute(LOCAL, (scope, "k1", tokens["k1"])).fetchone() == (None,)
        assert conn.execute(LOCAL_CLAIM, (scope, "c0")).fetchone() == (None,)
        conn.rollback()
    assert state("k1") == ("in_progress", None)

    shard, port = c.shard_of(scope)
    target = next(w.port for w in c.workers if w.port != port)
    moved: list[BaseException | None] = []

    def move() -> None:
        try:
            with psycopg.connect(c.dsn, autocommit=True) as conn:
                conn.execute(
                    "SELECT citus_move_shard_placement(%s, '127.0.0.1', %s, '127.0.0.1', %s,"
                    " shard_transfer_mode => 'block_writes')", (shard, port, target))
            moved.append(None)
        except BaseException as exc:  # noqa: BLE001 - reported below
            moved.append(exc)

    with psycopg.connect(home) as holder:
        assert holder.execute(LOCAL, (scope, "k1", tokens["k1"])).fetchone()[0] is not None
        mover = threading.Thread(target=move)
        mover.start()
        with psycopg.connect(home, autocommit=True) as watch:
            wait_until(lambda: watch.execute(
                "SELECT count(*) FROM pg_locks WHERE NOT granted").fetchone()[0] > 0,
                "the move waiting for the transaction that wrote the local shard")
        assert mover.is_alive() and not moved
        holder.commit()
    mover.join(WAIT_BOUND)
    assert moved == [None]
    assert state("k1") == ("completed", 201)
    with psycopg.connect(home, autocommit=True) as conn:
        assert conn.execute(LOCAL, (scope, "k2", tokens["k2"])).fetchone() == (None,)
        assert conn.execute(LOCAL_CLAIM, (scope, "c2")).fetchone() == (None,)
    assert rows("c2") == (0, 0)
    with psycopg.connect(away, autocommit=True) as conn:
        assert conn.execute(LOCAL, (scope, "k2", tokens["k2"])).fetchone()[0] is not None
        assert conn.execute(LOCAL_CLAIM, (scope, "c2")).fetchone() == ("claimed",)
    assert state("k2") == ("completed", 201)
    assert rows("c2") == (1, 1)

    with psycopg.connect(c.dsn, autocommit=True) as conn:
        lo, hi = conn.execute("SELECT shardminvalue::bigint, shardmaxvalue::bigint"
                              " FROM pg_dist_shard WHERE shardid = %s", (shard,)).fetchone()
        node = conn.execute("SELECT nodeid FROM pg_dist_node WHERE nodeport = %s",
                            (target,)).fetchone()[0]
        conn.execute("SELECT citus_split_shard_by_split_points(%s, ARRAY[%s], ARRAY[%s, %s],"
                     " shard_transfer_mode => 'block_writes')",
                     (shard, str((lo + hi) // 2), node, node))
        new = conn.execute("SELECT get_shard_id_for_distribution_column('idempotency.keys',"
                           " %s::text)", (scope,)).fetchone()[0]
    assert new != shard
    with psycopg.connect(away, autocommit=True) as conn:
        def branch() -> bool:
            return f"IF v_shard = {new} THEN" in conn.execute(
                "SELECT prosrc FROM pg_proc WHERE proname = '_complete_row_local'").fetchone()[0]

        assert not branch()
        assert conn.execute(LOCAL, (scope, "k3", tokens["k3"])).fetchone() == (None,)
        assert conn.execute(LOCAL_CLAIM, (scope, "c3")).fetchone() == (None,)
        # claim() itself, delegated: through Citus.
        assert conn.execute("SELECT outcome FROM idempotency.claim(%s, 'c3', '{}')",
                            (scope,)).fetchone() == ("claimed",)
        # complete() itself, delegated: through Citus.
        conn.execute("SELECT idempotency.complete(%s, 'k3', %s, 202, '{}')",
                     (scope, tokens["k3"]))
        with psycopg.connect(c.dsn, autocommit=True) as coordinator:
            coordinator.execute("SELECT idempotency.maintain()")
        assert branch()
        assert conn.execute(LOCAL, (scope, "k4", tokens["k4"])).fetchone()[0] is not None
        assert conn.execute(LOCAL_CLAIM, (scope, "c4")).fetchone() == ("claimed",)
    assert (state("k3"), state("k4")) == (("completed", 202), ("completed", 201))
    assert (rows("c3"), rows("c4")) == ((1, 1), (1, 1))
    c.cluster.drop_database(c.db)


def test_a_common_claim_skips_the_checks_and_goes_to_its_local_half(citus: Cluster) -> None:
    """On a cluster claim()'s checks (_check_name, _check_lease...) are planned afresh on every
    call, so a claim that passes the common-path test (our own fingerprint, a valid name and
    lease) skips them and goes straight to _claim_row_local; a claim with a request takes the
    checks. Counted with track_functions on the worker that runs the delegated calls."""
    scope = _scope()
    home = citus.node_of(scope)
    counted = ("_check_name", "_check_lease", "_claim_row_local")

    def calls(conn: psycopg.Connection) -> dict[str, int]:
        return dict(conn.execute(
            "SELECT funcname, calls FROM pg_stat_user_functions"
            " WHERE schemaname = 'idempotency' AND funcname = ANY (%s)",
            (list(counted),)).fetchall())

    def after(conn: psycopg.Connection, before: dict[str, int], local: int) -> dict[str, int]:
        """The calls since before, once the worker's backend has flushed the local half's."""
        deadline = time.monotonic() + 10
        while True:
            conn.execute("SELECT pg_stat_clear_snapshot()")
            now = calls(conn)
            delta = {f: now.get(f, 0) - before.get(f, 0) for f in counted}
            if delta["_claim_row_local"] >= local or time.monotonic() > deadline:
                return delta
            time.sleep(0.2)

    with psycopg.connect(home, autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET track_functions = 'all'")
        conn.execute("SELECT pg_reload_conf()")
    try:
        time.sleep(0.5)  # the reload reaches the backends that serve the coordinator
        with psycopg.connect(home, autocommit=True) as watch:
            before = calls(watch)
            with psycopg.connect(citus.dsn, autocommit=True) as conn:
                for n in range(3):
                    assert conn.execute(idem.queries.CLAIM, {
                        "scope": scope, "key": f"fp{n}", "request": None,
                        "lease": timedelta(seconds=30), "fingerprint": bytes(32),
                        "strict": False, "reference_time": None}).fetchone()[0] == "claimed"
            assert after(watch, before, 3) == {
                "_check_name": 0, "_check_lease": 0, "_claim_row_local": 3}
            before = calls(watch)
            assert _claim(citus.dsn, scope, "req")[0] == "claimed"
            assert after(watch, before, 1) == {
                "_check_name": 2, "_check_lease": 1, "_claim_row_local": 1}
    finally:
        with psycopg.connect(home, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM RESET track_functions")
            conn.execute("SELECT pg_reload_conf()")


def test_distribute_says_when_citus_is_absent(citus_cluster: Any) -> None:
    """On a database without the citus extension: IK021, nothing changed."""
    db = f"idem_plain_{uuid.uuid4().hex[:8]}"
    coord = citus_cluster.coordinator
    with psycopg.connect(coord.dsn("postgres"), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(db)))
    try:
        for migration in sorted(MIGRATIONS.glob("*.sql")):
            coord.run_psql(coord.dsn(db), migration, args=MIGRATION_PSQL_ARGS)
        assert sqlstate(coord.dsn(db), "SELECT idempotency.distribute()") == "IK021"
        assert _claim(coord.dsn(db), "s", "k")[0] == "claimed"
    finally:
        with psycopg.connect(coord.dsn("postgres"), autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(db)))


def test_distribute_on_a_worker_says_so(citus: Cluster) -> None:
    """A worker holds the functions too (distribute() creates them on every node), but only
    the coordinator may distribute: IK022 there, and the worker's metadata is unchanged."""
    for dsn in citus.worker_dsns():
        with psycopg.connect(dsn, autocommit=True) as conn:
            before = conn.execute("SELECT count(*) FROM pg_dist_partition").fetchone()
        assert sqlstate(dsn, "SELECT idempotency.distribute()") == "IK022"
        with psycopg.connect(dsn, autocommit=True) as conn:
            assert conn.execute("SELECT count(*) FROM pg_dist_partition").fetchone() == before


# -- uniqueness ------------------------------------------------------------------------------

MODES = ["delegated", "subquery", "transaction", "worker"]


def _claim_by(mode: str, citus: Cluster, scope: str, key: str, request: str) -> str:
    if mode == "worker":
        # Straight to a worker, alternately the one holding the shard and the other one.
        dsn = citus.worker_dsns()[hash((scope, key, threading.get_ident())) % 2]
    else:
        dsn = citus.dsn
    with psycopg.connect(dsn, autocommit=True) as conn:
        if mode == "subquery":
            # Not delegated: the body runs on the coordinator, statement by statement.
            return conn.execute(
                "SELECT (c).outcome FROM (SELECT idempotency.claim(%s, %s, %s::jsonb) AS c"
                " OFFSET 0) AS s", (scope, key, request)).fetchone()[0]
        if mode == "transaction":
            with conn.transaction():
                conn.execute("SELECT 1")
                return conn.execute("SELECT outcome FROM idempotency.claim(%s, %s, %s::jsonb)",
                                    (scope, key, request)).fetchone()[0]
        return conn.execute("SELECT outcome FROM idempotency.claim(%s, %s, %s::jsonb)",
                            (scope, key, request)).fetchone()[0]


def test_one_owner_per_key_whichever_way_claims_arrive(citus: Cluster) -> None:
    """24 sessions claim each of 6 keys at once, through the coordinator (delegated, in a
    subquery, in a transaction) and straight to the workers: one claimed per key."""
    scope = _scope()
    sessions = 24
    keys = [f"k{i}" for i in range(6)]
    for key in keys:
        barrier = threading.Barrier(sessions)
        outcomes: list[tuple[str, str]] = []
        lock = threading.Lock()

        def run(i: int, key: str = key, barrier: threading.Barrier = barrier,
                outcomes: list[tuple[str, str]] = outcomes, lock: threading.Lock = lock) -> None:
            mode = MODES[i % len(MODES)]
            barrier.wait()
            got = _claim_by(mode, citus, scope, key, '{"n": 1}')
            with lock:
                outcomes.append((mode, got))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(sessions)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        counts = Counter(o for _, o in outcomes)
        assert counts == {"claimed": 1, "in_progress": sessions - 1}, (key, outcomes)
    with psycopg.connect(citus.dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*), count(DISTINCT key) FROM idempotency.keys"
                            " WHERE scope = %s", (scope,)).fetchone() == (6, 6)
        assert conn.execute("SELECT count(*) FROM idempotency.key_directory WHERE scope = %s",
                            (scope,)).fetchone() == (6,)


def test_no_advisory_lock_takes_part(citus: Cluster) -> None:
    """The engine's functions take no advisory lock on the key path any more."""
    with psycopg.connect(citus.dsn, autocommit=True) as conn:
        users = conn.execute(
            "SELECT proname FROM pg_proc WHERE pronamespace = 'idempotency'::regnamespace"
            " AND prosrc ~ '_lock_name\\(1|advisory_xact_lock\\(1'").fetchall()
    assert users == []


# -- fencing and tokens ----------------------------------------------------------------------

def test_tokens_grow_with_every_owner_and_stale_owners_are_refused(citus: Cluster) -> None:
    """Claim, then takeovers through the coordinator, in a subquery, on each worker, then a
    release and a new claim: each owner's token is greater than every earlier one, and every
    earlier owner's fenced call is refused with IK001."""
    scope, key = _scope(), "pay-1"
    tokens = [_claim(citus.dsn, scope, key, lease="1 second")[1]]
    # The test clock starts after the first claim has returned, so that its 1-second lease has
    # expired at ref(2) however long the claim took on a loaded machine.
    t0 = time.time()
    ref = lambda s: f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(t0 + s))}+00"  # noqa: E731
    takeover_dsns = [citus.dsn, citus.dsn, *citus.worker_dsns()]
    for i, dsn in enumerate(takeover_dsns, start=1):
        with psycopg.connect(dsn, autocommit=True) as conn:
            # reference_time: the owner's test clock (the tests connect as the owner).
            query = ("SELECT (c).outcome, (c).lease_token FROM (SELECT idempotency.claim("
                     "%s, %s, '{}', lease => '1 second', reference_time => %s) AS c OFFSET 0)"
                     " AS s") if i == 2 else (
                "SELECT outcome, lease_token FROM idempotency.claim(%s, %s, '{}',"
                " lease => '1 second', reference_time => %s)")
            outcome, token = conn.execute(query, (scope, key, ref(2 * i))).fetchone()
        assert outcome == "resumed"
        tokens.append(token)
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens), tokens
    current = tokens[-1]
    with psycopg.connect(citus.dsn, autocommit=True) as conn:
        conn.execute("SELECT idempotency.release(%s, %s, %s)", (scope, key, current))
    new = _claim(citus.dsn, scope, key, '{"other": 1}')
    assert new[0] == "claimed" and new[1] > max(tokens)
    stale_calls = {
        "complete": "SELECT idempotency.complete(%s, %s, %s, 200, '{}')",
        "heartbeat": "SELECT idempotency.heartbeat(%s, %s, %s)",
        "checkpoint": "SELECT idempotency.checkpoint(%s, %s, %s, 'step')",
        "accept": "SELECT idempotency.accept(%s, %s, %s, 202, '{}')",
        "release": "SELECT idempotency.release(%s, %s, %s)",
    }
    for name, query in stale_calls.items():
        for token in tokens:
            assert sqlstate(citus.dsn, query, (scope, key, token)) == "IK001", (name, token)
    # The current owner still owns it.
    with psycopg.connect(citus.dsn, autocommit=True) as conn:
        conn.execute("SELECT idempotency.complete(%s, %s, %s, 201, '{}')", (scope, key, new[1]))
        assert conn.execute("SELECT state, lease_token FROM idempotency.keys WHERE scope = %s",
                            (scope,)).fetchall() == [("completed", new[1])]


def test_guessing_a_token_gets_nothing_and_tells_nothing(citus: Cluster,
                                                           citus_roles: list[str]) -> None:
    """As an application role: 300 guesses around a live key's token (the old sequence's next
    numbers and the token's neighbours) are all refused, and a wrong token answers the same
    (IK001, same text) whether the key is in progress, completed, released or absent."""
    request_role = citus_roles[0]
    scope = _scope()
    live = _claim(citus.dsn, scope, "live")[1]
    done = _claim(citus.dsn, scope, "done")[1]
    gone = _claim(citus.dsn, scope, "released")[1]
    with psycopg.connect(citus.dsn, autocommit=True) as conn:
        conn.execute("SELECT idempotency.complete(%s, 'done', %s, 200, '{}')", (scope, done))
        conn.execute("SELECT idempotency.release(%s, 'released', %s)", (scope, gone))
    guesses = [live + d for d in range(-100, 101) if d] + list(range(1, 100))
    dsn = citus.coordinator.dsn(citus.db, user=request_role)
    with psycopg.connect(dsn, autocommit=True) as conn:
        refused = 0
        for guess in guesses:
            try:
                conn.execute("SELECT idempotency.heartbeat(%s, 'live', %s)", (scope, guess))
            except psycopg.Error as exc:
                refused += exc.sqlstate == "IK001"
        assert refused == len(guesses)
        answers = set()
        for key in ("live", "done", "released", "never-claimed"):
            for fn in ("complete(%s, %s, 12345, 200, '{}')", "heartbeat(%s, %s, 12345)",
                       "release(%s, %s, 12345)"):
                try:
                    conn.execute(f"SELECT idempotency.{fn}", (scope, key))
                except psycopg.Error as exc:
                    answers.add((fn.split("(")[0], exc.sqlstate,
                                 exc.diag.message_primary.replace(json.dumps(key), "KEY"),
                                 exc.diag.message_detail))
    assert {(a[0], a[1]) for a in answers} == {("complete", "IK001"), ("heartbeat", "IK001"),
                                                ("release", "IK001")}
    assert len(answers) == 3, answers
    # Nothing changed: the live key is in progress under its token.
    with psycopg.connect(citus.dsn, autocommit=True) as conn:
        assert conn.execute("SELECT state, lease_token FROM idempotency.keys"
                            " WHERE scope = %s AND key = 'live'", (scope,)).fetchone() == (
            "in_progress", live)


@pytest.fixture(scope="session")
def citus_roles(citus: Cluster) -> Iterator[list[str]]:
    """A request role and a completer role, made on the coordinator as docs/install.md says
    (Citus creates them on the workers and grants there too)."""
    roles = [f"request_{uuid.uuid4().hex[:6]}", f"completer_{uuid.uuid4().hex[:6]}"]
    with psycopg.connect(citus.dsn, autocommit=True) as conn:
        for role, kind in zip(roles, ("request", "completer"), strict=True):
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
            conn.execute("SELECT idempotency.grant_usage(%s::regrole, kind => %s)", (role, kind))
    yield roles


def test_application_roles_work_through_the_coordinator(citus: Cluster,
                                                        citus_roles: list[str]) -> None:
    """The request role claims, completes and replays; the completer lists an abandoned key
    and takes it over; neither reads a table."""
    request_role, completer_role = citus_roles
    scope = _scope()
    with psycopg.connect(citus.coordinator.dsn(citus.db, user=request_role),
                         autocommit=True) as conn:
        token = conn.execute("SELECT lease_token FROM idempotency.claim(%s, 'a', '{}')",
                             (scope,)).fetchone()[0]
        conn.execute("SELECT idempotency.complete(%s, 'a', %s, 201, '{\"id\": 1}')",
                     (scope, token))
        assert conn.execute("SELECT outcome, response_body FROM idempotency.claim(%s, 'a', '{}')",
                            (scope,)).fetchone() == ("replay", {"id": 1})
        conn.execute("SELECT idempotency.claim(%s, 'b', '{}', lease => '1 second')", (scope,))
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("SELECT count(*) FROM idempotency.keys")
    time.sleep(1.2)
    with psycopg.connect(citus.coordinator.dsn(citus.db, user=completer_role),
                         autocommit=True) as conn:
        with conn.transaction():
            found = conn.execute("SELECT key FROM idempotency.list_abandoned(scope => %s)",
                                 (scope,)).fetchall()
            assert found == [("b",)]
        assert conn.execute("SELECT outcome FROM idempotency.takeover(%s, 'b')",
                            (scope,)).fetchone() == ("resumed",)


# -- the business transaction on one worker --------------------------------------------------

@pytest.fixture(scope="session")
def ledger(citus: Cluster) -> str:
    """A ledger distributed by account, co-located with the keys (docs/scale-out.md)."""
    with psycopg.connect(citus.dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE ledger (account text NOT NULL, payment text NOT NULL,"
                     " amount integer NOT NULL, PRIMARY KEY (account, payment))")
        conn.execute("SELECT create_distributed_table('ledger', 'account',"
                     " colocate_with => 'idempotency.keys')")
    return "ledger"


def test_business_write_and_complete_commit_together(citus: Cluster, ledger: str) -> None:
    scope = _scope()
    token = _claim(citus.dsn, scope, "p1", lease="1 second")[1]
    with psycopg.connect(citus.dsn) as conn:
        conn.execute("INSERT INTO ledger VALUES (%s, 'p1', 50)", (scope,))
        conn.execute("SELECT idempotency.complete(%s, 'p1', %s, 201, '{}')", (scope, token))
        conn.commit()
    # A stale owner: its lease expired and a retry took the key over.
    token2 = _claim(citus.dsn, scope, "p2", lease="1 second")[1]
    time.sleep(1.1)
    assert _claim(citus.dsn, scope, "p2")[0] == "resumed"
    with psycopg.connect(citus.dsn) as conn:
        conn.execute("INSERT INTO ledger VALUES (%s, 'p2', 70)", (scope,))
        with pytest.raises(psycopg.Error) as info:
            conn.execute("SELECT idempotency.complete(%s, 'p2', %s, 201, '{}')", (scope, token2))
        assert info.value.sqlstate == "IK001"
        conn.rollback()
    with psycopg.connect(citus.node_of(scope), autocommit=True) as conn:
        # Both the ledger and the key live on the scope's worker.
        assert conn.execute("SELECT payment FROM ledger WHERE account = %s ORDER BY 1",
                            (scope,)).fetchall() == [("p1",)]
        assert conn.execute("SELECT key, state FROM idempotency.keys WHERE scope = %s ORDER BY 1",
                            (scope,)).fetchall() == [("p1", "completed"), ("p2", "in_progress")]


def test_python_operation_against_the_coordinator(citus: Cluster, ledger: str) -> None:
    """pg_idempotency.operation(): claim, the ledger insert and complete in one transaction,
    then a replay; and the same through the async API."""
    scope = _scope()
    with psycopg.connect(citus.dsn) as conn:
        for _ in range(2):
            with idem.operation(conn, scope, "order-1", {"amount": 5}) as op:
                if op.replay:
                    assert op.replay.status == 201 and op.replay.json() == {"id": "o1"}
                    break
                conn.execute("INSERT INTO ledger VALUES (%s, 'order-1', 5)", (scope,))
                op.complete(201, {"id": "o1"})
        else:
            pytest.fail("the second operation() did not replay")

    async def run_async() -> None:
        async with await psycopg.AsyncConnection.connect(citus.dsn) as aconn:
            async with aio.operation(aconn, scope, "order-2", {"amount": 6}) as op:
                assert op.replay is None
                await aconn.execute("INSERT INTO ledger VALUES (%s, 'order-2', 6)", (scope,))
                await op.complete(201, {"id": "o2"})

    import asyncio
    asyncio.run(run_async())
    with psycopg.connect(citus.dsn, autocommit=True) as conn:
        assert conn.execute("SELECT payment FROM ledger WHERE account = %s ORDER BY 1",
                            (scope,)).fetchall() == [("order-1",), ("order-2",)]


def test_sqlalchemy_session_against_the_coordinator(citus: Cluster, ledger: str) -> None:
    """pg_idempotency.sqlalchemy: an ORM session's write to the co-located ledger commits with
    the response; a retry replays; an error rolls the write back and releases the key."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.orm import Session

    from pg_idempotency.sqlalchemy import operation as sa_operation

    scope = _scope()
    engine = create_engine("postgresql+psycopg://" + citus.dsn.split("://", 1)[1])
    try:
        insert = text("INSERT INTO ledger VALUES (:a, :p, 9)")
        with Session(engine) as session:
            with sa_operation(session, scope, "sa-1", {"n": 1}) as op:
                assert op.replay is None
                session.execute(insert, {"a": scope, "p": "sa-1"})
                op.complete(201, {"ok": True})
            with sa_operation(session, scope, "sa-1", {"n": 1}) as op:
                assert op.replay is not None and op.replay.json() == {"ok": True}
            with pytest.raises(RuntimeError), sa_operation(session, scope, "sa-2", {"n": 2}):
                session.execute(insert, {"a": scope, "p": "sa-2"})
                raise RuntimeError("boom")
    finally:
        engine.dispose()
    with psycopg.connect(citus.dsn, autocommit=True) as conn:
        assert conn.execute("SELECT payment FROM ledger WHERE account = %s",
                            (scope,)).fetchall() == [("sa-1",)]
        assert conn.execute("SELECT key, state FROM idempotency.keys WHERE scope = %s"
                            " ORDER BY key", (scope,)).fetchall() == [
            ("sa-1", "completed"), ("sa-2", "released")]


def test_asgi_middleware_through_the_coordinator(citus_cluster: Any) -> None:
    """The FastAPI payments example (examples/payments/app.py), unchanged, with its DSN pointing
    at the coordinator: 30 concurrent identical POSTs through a real uvicorn server give one
    ledger row and one charge, 29 byte-identical replays. Its ledger is a plain table on the
    coordinator, so its insert and the delegated complete() commit by two-phase commit."""
    import asyncio

    import httpx
    from helpers.http import payments, uvicorn_server

    c = installed(citus_cluster, "idem_mw", 4)
    processor = payments.FakeProcessor(delay=0.3)
    app = payments.create_app(c.dsn, processor, wait=20)

    async def fire(base: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base, timeout=WAIT_BOUND,
                                     limits=httpx.Limits(max_connections=30)) as client:
            return await asyncio.gather(*(client.post(
                "/payments", json={"amount": 70, "currency": "EUR"},
                headers={"X-Account": "acct_citus", "Idempotency-Key": "same"})
                for _ in range(30)))

    with uvicorn_server(app) as base:
        responses = asyncio.run(fire(base))
    assert [r.status_code for r in responses] == [201] * 30, [r.text for r in responses]
    assert len({r.content for r in responses}) == 1
    assert sum(r.headers.get("idempotent-replayed") == "true" for r in responses) == 29
    assert processor.calls == 1
    with psycopg.connect(c.dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM ledger").fetchone() == (1,)
        assert conn.execute("SELECT state FROM idempotency.keys WHERE scope = 'acct_citus'"
                            ).fetchall() == [("completed",)]


# -- operations ------------------------------------------------------------------------------

def test_maintain_and_status_through_the_coordinator(citus: Cluster) -> None:
    """maintain() makes and drops partitions on every shard, tombstones included, and deletes
    the directory rows of what it drops; key_status and partition_status read all shards."""
    with psycopg.connect(citus.dsn, autocommit=True) as conn:
        scope = _scope()
        # A key of three days ago (the owner's test clock), in a partition made for then.
        earlier = "now() - interval '3 days'"
        conn.execute(f"SELECT idempotency._premake({earlier})")
        token = conn.execute("SELECT lease_token FROM idempotency.claim(%s, 'old', '{}',"
                             f" reference_time => {earlier})", (scope,)).fetchone()[0]
        conn.execute("SELECT idempotency.complete(%s, 'old', %s, 200, '{}',"
                     f" reference_time => {earlier})", (scope, token))
        conn.execute("UPDATE idempotency.settings SET tombstones = true")
        try:
            # A newer key: maintain() never drops the newest interval holding keys.
            conn.execute("SELECT idempotency.claim(%s, 'newer', '{}')", (_scope(),))
            actions = conn.execute(
                "SELECT action, parent_table, partition_name FROM idempotency.maintain()"
            ).fetchall()
            assert ("tombstoned", "keys") in {(a, p) for a, p, _ in actions}
            created = [n for a, p, n in actions if a == "created" and p == "tombstones"]
            dropped = [n for a, p, n in actions if a == "dropped" and p == "keys"]
            assert created and dropped, actions
            # Every shard placement of a new partition exists on the workers.
            placements = conn.execute(
                "SELECT count(*) FROM citus_shards WHERE table_name::text = %s",
                (f"idempotency.{created[0]}",)).fetchone()[0]
            assert placements == 8
            assert conn.execute("SELECT outcome FROM idempotency.claim(%s, 'old', '{}')",
                                (scope,)).fetchone() == ("expired",)
            status = conn.execute("SELECT state, keys FROM idempotency.key_status() WHERE scope"
                                  " = %s", (scope,)).fetchall()
            assert status == [("tombstone", 1)]
            parts = conn.execute("SELECT DISTINCT parent_table FROM"
                                 " idempotency.partition_status()").fetchall()
            assert {p for (p,) in parts} == {"keys", "inbox", "tombstones"}
        finally:
            conn.execute("UPDATE idempotency.settings SET tombstones = false")
            conn.execute("SELECT count(*) FROM idempotency.maintain()")


def test_shard_move_under_load_loses_and_duplicates_nothing(citus: Cluster, ledger: str) -> None:
    """While 6 sessions claim and complete payments of one busy tenant (each with its ledger
    row), that tenant's shard group moves to the other worker. Afterwards every key has one
    row, every completed key one ledger row, and a takeover after the move gets a greater
    token than before it."""
    scope = _scope()
    stop = threading.Event()
    errors_seen: list[str] = []
    done: list[str] = []
    lock = threading.Lock()

    def worker(n: int) -> None:
        i = 0
        with psycopg.connect(citus.dsn) as conn:
            while not stop.is_set() and i < 400:
                i += 1
                key = f"w{n}-{i}"
                try:
                    conn.autocommit = True
                    outcome, token = conn.execute(
                        "SELECT outcome, lease_token FROM idempotency.claim(%s, %s, '{}')",
                        (scope, key)).fetchone()
                    conn.autocommit = False
                    assert outcome == "claimed"
                    conn.execute("INSERT INTO ledger VALUES (%s, %s, 1)", (scope, key))
                    conn.execute("SELECT idempotency.complete(%s, %s, %s, 201, '{}')",
                                 (scope, key, token))
                    conn.commit()
                    with lock:
                        done.append(key)
                except psycopg.Error as exc:  # a call cut off by the move: retried below
                    conn.rollback()
                    with lock:
                        errors_seen.append(f"{key}: {exc.sqlstate} {exc}")

    stale = _claim(citus.dsn, scope, "moving", lease="1 second")[1]
    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    # Load on the shard before the move, and after it: counted completions, not seconds.
    wait_until(lambda: len(done) >= 25 or not any(t.is_alive() for t in threads),
               "25 completions before the move")
    shard, port = citus.shard_of(scope)
    target = next(w.port for w in citus.workers if w.port != port)
    with psycopg.connect(citus.dsn, autocommit=True) as conn:
        conn.execute("SELECT citus_move_shard_placement(%s, '127.0.0.1', %s, '127.0.0.1', %s,"
                     " shard_transfer_mode => 'block_writes')", (shard, port, target))
        moved_to = conn.execute(
            "SELECT nodeport FROM citus_shards WHERE shardid = %s", (shard,)).fetchone()[0]
    after_move = len(done)
    wait_until(lambda: len(done) >= after_move + 25 or not any(t.is_alive() for t in threads),
               "25 completions after the move")
    stop.set()
    for t in threads:
        t.join(WAIT_BOUND)
    assert not any(t.is_alive() for t in threads)
    assert moved_to == target
    assert len(done) >= after_move + 25 >= 50, (len(done), errors_seen[:5])
    with psycopg.connect(citus.dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT k.key, k.state, (SELECT count(*) FROM ledger AS l WHERE l.account = k.scope"
            " AND l.payment = k.key) FROM idempotency.keys AS k WHERE k.scope = %s"
            " AND k.key <> 'moving'", (scope,)).fetchall()
        by_key = {k: (s, n) for k, s, n in rows}
        assert len(by_key) == len(rows)  # one row per key
        for key in done:
            assert by_key[key] == ("completed", 1), key
        # Keys whose call was cut off: in progress without a ledger row, or completed with one.
        for key, (state, n) in by_key.items():
            assert (state, n) in {("completed", 1), ("in_progress", 0)}, (key, state, n)
        assert conn.execute("SELECT count(*) FROM ledger WHERE account = %s",
                            (scope,)).fetchone()[0] == sum(n for _, n in by_key.values())
        assert conn.execute("SELECT count(*) FROM idempotency.key_directory WHERE scope = %s",
                            (scope,)).fetchone()[0] == len(by_key) + 1
    time.sleep(1.0)
    after = _claim(citus.dsn, scope, "moving")
    assert after[0] == "resumed" and after[1] > stale


# -- the conformance scenarios through the coordinator -----------------------------------------

def _citus_scenario(path: Path) -> dict[str, Any]:
    """The scenario as it runs through a coordinator: the same steps and expectations, but an
    error's COLUMN field is not expected. Citus passes an error raised on a worker on with its
    SQLSTATE, message, DETAIL and HINT only (documented in docs/scale-out.md); the message
    still names the argument, which test_argument_errors_name_the_argument checks."""
    scenario = copy.deepcopy(conf.load_scenario(path))
    for step in scenario["steps"]:
        if "error" in step:
            step["error"].pop("column", None)
    return scenario


@pytest.fixture(scope="session")
def citus_scenario_files(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    out = tmp_path_factory.mktemp("citus_scenarios")
    files = []
    for path in FILES:
        target = out / path.name
        target.write_text(json.dumps(_citus_scenario(path)), encoding="utf-8")
        files.append(target)
    return files


ARGUMENT_ERRORS = [
    ("SELECT idempotency.claim(NULL, 'k', '{}')", "IK010", "scope"),
    ("SELECT idempotency.claim('s', NULL, '{}')", "IK010", "key"),
    ("SELECT idempotency.claim('s', '', '{}')", "IK011", "key"),
    ("SELECT idempotency.claim('s', 'k', '{}', lease => '0 seconds')", "IK014", "lease"),
    ("SELECT idempotency.heartbeat('s', 'k', NULL)", "IK010", "lease_token"),
    # The outcome forms answer a lost lease without an error, never a bad argument.
    ("SELECT idempotency.heartbeat_outcome('s', 'k', NULL)", "IK010", "lease_token"),
    ("SELECT idempotency.checkpoint_outcome('s', 'k', 1, NULL)", "IK010", "recovery_point"),
    ("SELECT idempotency.release_outcome('s', '', 1)", "IK011", "key"),
    ("SELECT idempotency.complete('s', 'k', 1, 99, '{}')", "IK014", "status"),
    ("SELECT idempotency.inbox_accept('c', NULL)", "IK010", "message_id"),
]


@pytest.mark.parametrize(("query", "sqlstate", "argument"), ARGUMENT_ERRORS)
def test_argument_errors_name_the_argument(citus: Cluster, query: str, sqlstate: str,
                                           argument: str) -> None:
    """Through the coordinator the SQLSTATE and the message name the argument (COLUMN may be
    missing: Citus drops it), and the Python package still reports the argument."""
    with psycopg.connect(citus.dsn, autocommit=True) as conn:
        with pytest.raises(psycopg.Error) as info:
            conn.execute(query)
    exc = info.value
    assert exc.sqlstate == sqlstate
    assert f'argument "{argument}"' in exc.diag.message_primary
    assert exc.diag.column_name in (None, argument)
    translated = from_psycopg(exc)
    assert isinstance(translated, idem.InvalidArgument) and translated.argument == argument


@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_python_runner_through_the_coordinator(conformance_citus: str, path: Path) -> None:
    assert pyrunner.run_scenario(conformance_citus, _citus_scenario(path), API) == []


@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_psql_runner_through_the_coordinator(citus_cluster: Any, conformance_citus: str,
                                             path: Path) -> None:
    scenario = _citus_scenario(path)
    script, checks = psqlrunner.generate(scenario, API)
    proc = citus_cluster.coordinator.run_psql(conformance_citus, script,
                                              args=psqlrunner.PSQL_ARGS, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert psqlrunner.check_output(scenario, checks, proc.stdout, proc.stderr) == []


@pytest.mark.parametrize("lang", ["node", *langs.LANGS])
def test_other_runners_through_the_coordinator(conformance_citus: str,
                                               citus_scenario_files: list[Path],
                                               lang: str) -> None:
    """Node, Java, Go and Ruby: every scenario, each runner in one process."""
    if lang == "node":
        from conformance.langs import run_node
        code, results, stderr = run_node(conformance_citus, citus_scenario_files)
    else:
        code, results, stderr = langs.run_runner(lang, conformance_citus, citus_scenario_files)
    assert sorted(results) == sorted(IDS), stderr
    assert {k: v for k, v in results.items() if v} == {}
    assert code == 0, stderr


@pytest.fixture(scope="session")
def conformance_citus(citus_cluster: Any) -> Iterator[str]:
    """A database of its own (the scenarios TRUNCATE the tables), distributed."""
    yield installed(citus_cluster, "idem_conf", 4).dsn


def test_prepared_statements_opt_in_through_the_coordinator(
        citus: Cluster, citus_roles: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """allow_prepared_statements() on Citus, as the request role through the coordinator:
    past psycopg's threshold the claim and complete are prepared statements on the coordinator
    (generic plans, the scope a parameter), and each call is still delegated to the scope's
    worker in one command, with the same answers; a SQLAlchemy session as well."""
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    from pg_idempotency import _exec
    from pg_idempotency.sqlalchemy import operation as sa_operation

    monkeypatch.setattr(_exec, "PREPARE", False)  # restored after the test
    idem.allow_prepared_statements()
    request_role = citus_roles[0]
    dsn = citus.coordinator.dsn(citus.db, user=request_role)
    scope = _scope()
    with psycopg.connect(dsn, autocommit=True) as conn:
        for i in range(8):
            with idem.operation(conn, scope, f"p{i}", {"i": i}) as op:
                assert op.outcome == "claimed"
                op.complete(201, {"i": i})
        prepared = conn.execute("SELECT statement FROM pg_prepared_statements",
                                prepare=False).fetchall()
        texts = " ".join(r[0] for r in prepared)
        assert "idempotency.claim(" in texts and "idempotency.complete" in texts, prepared
        notices: list[str] = []
        conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
        conn.execute("SET citus.log_remote_commands = on", prepare=False)
        conn.execute("SET client_min_messages = log", prepare=False)
        replay = idem.claim(conn, scope, "p3", {"i": 3})
        assert replay.outcome == "replay" and replay.response.json() == {"i": 3}
        held = idem.claim(conn, scope, "p9", {"i": 9})
        assert held.outcome == "claimed"
        issued = [n for n in notices if n.startswith("issuing")]
        assert len(issued) == 2 and all("idempotency.claim(" in n for n in issued), issued
    engine = create_engine("postgresql+psycopg://" + dsn.split("://", 1)[1])
    try:
        with Session(engine) as session:
            for i in range(6):
                with sa_operation(session, scope, f"sa{i}", {"n": i}) as op:
                    assert op.replay is None
                    op.complete(201, {"n": i})
            with sa_operation(session, scope, "sa0", {"n": 0}) as op:
                assert op.replay is not None and op.replay.json() == {"n": 0}
    finally:
        engine.dispose()
    with psycopg.connect(citus.node_of(scope), autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FILTER (WHERE state = 'completed'),"
                            " count(*) FILTER (WHERE state = 'in_progress')"
                            " FROM idempotency.keys WHERE scope = %s",
                            (scope,)).fetchone() == (14, 1)
