"""A distributed install on the session's Citus cluster (tests/conftest.py's ``citus_cluster``),
and what a call costs the workers, for tests/citus/ and the Citus tests of other folders."""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from helpers import MIGRATION_PSQL_ARGS, MIGRATIONS
from pgharness import wait_until


class Cluster:
    """One database on every node of the session's cluster, installed and distributed."""

    def __init__(self, cluster: Any, db: str) -> None:
        self.cluster = cluster
        self.db = db
        self.coordinator = cluster.coordinator
        self.workers = list(cluster.workers)

    @property
    def dsn(self) -> str:
        return self.coordinator.dsn(self.db)

    def worker_dsns(self) -> list[str]:
        return [w.dsn(self.db) for w in self.workers]

    def shard_of(self, scope: str) -> tuple[int, int]:
        """scope's shard of keys and the port of the worker that holds it."""
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return conn.execute(
                "SELECT shardid, nodeport FROM citus_shards"
                " WHERE table_name = 'idempotency.keys'::regclass"
                " AND shardid = get_shard_id_for_distribution_column('idempotency.keys', %s::text)",
                (scope,)).fetchone()

    def node_of(self, scope: str) -> str:
        """DSN of the worker that holds scope's shard of keys."""
        port = self.shard_of(scope)[1]
        return next(w.dsn(self.db) for w in self.workers if w.port == port)


def installed(citus_cluster: Any, prefix: str, shards: int, *, delegate: bool = True) -> Cluster:
    """A new database on every node, installed as docs/scale-out.md says: the migrations on the
    coordinator, then distribute(shards, delegate). Delegated unless asked otherwise: the
    project's Citus builds carry the delegation guard (tools/build_citus.py), and most Citus
    tests check what delegation does. test_citus_shapes.py and
    test_citus.py::test_distribute_delegates_only_when_asked_and_undoes_it run the default,
    undelegated install; calls that are not delegated (a subquery, a client on a worker) run
    in the delegated installs too."""
    db = f"{prefix}_{uuid.uuid4().hex[:8]}"
    citus_cluster.create_database(db)
    c = Cluster(citus_cluster, db)
    for migration in sorted(MIGRATIONS.glob("*.sql")):
        c.coordinator.run_psql(c.dsn, migration, args=MIGRATION_PSQL_ARGS)
    with psycopg.connect(c.dsn, autocommit=True) as conn:
        done = conn.execute("SELECT object, action FROM idempotency.distribute(%s, delegate => %s)",
                            (shards, delegate)).fetchall()
    assert ("idempotency.keys", "distributed by scope") in done
    return c


def synchronous_commit(cluster: Cluster, value: str) -> None:
    """``synchronous_commit`` for the sessions opened from now on in the cluster's database,
    on every node (Citus does not propagate ALTER DATABASE ... SET to the workers)."""
    for node in cluster.cluster.nodes:
        with psycopg.connect(node.dsn(cluster.db), autocommit=True) as conn:
            conn.execute("SET citus.enable_ddl_propagation = off")
            conn.execute(sql.SQL("ALTER DATABASE {} SET synchronous_commit = {}").format(
                sql.Identifier(cluster.db), sql.SQL(value)))

CALLS = 30


def _others(watchers: list[psycopg.Connection[Any]]) -> set[tuple[int, int]]:
    return {(i, pid) for i, conn in enumerate(watchers) for (pid,) in conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
        " AND pid <> pg_backend_pid() AND backend_type = 'client backend'").fetchall()}


def _sessions(watchers: list[psycopg.Connection[Any]], baseline: set[tuple[int, int]]) -> int:
    """Sessions ever started in this database on the workers (pg_stat_database.sessions),
    once every backend not in ``baseline`` has ended (and so flushed its statistics)."""
    wait_until(lambda: _others(watchers) <= baseline, "the worker backends to end",
               interval=0.05)
    total = 0
    for conn in watchers:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        total += conn.execute("SELECT sessions FROM pg_stat_database"
                              " WHERE datname = current_database()").fetchone()[0]
    return total


def _measure(cluster: Any, call: Callable[[psycopg.Connection[Any]], str | None],
             dsn: str | None = None) -> tuple[float, float, list[str | None]]:
    """New worker sessions per call and the median call time in ms, over CALLS calls in one
    coordinator session (``dsn``, by default the owner's; its first call opens the worker
    connection in any case: not counted); and the answers (what ``call`` returns)."""
    watchers = [psycopg.connect(w.dsn(cluster.db), autocommit=True) for w in cluster.workers]
    baseline = _others(watchers)
    before = _sessions(watchers, baseline)
    answers, times = [], []
    with psycopg.connect(dsn or cluster.dsn, autocommit=True) as conn:
        call(conn)
        for _ in range(CALLS):
            start = time.perf_counter()
            answers.append(call(conn))
            times.append((time.perf_counter() - start) * 1000)
    new = _sessions(watchers, baseline) - before - 1
    for w in watchers:
        w.close()
    return new / CALLS, statistics.median(times), answers


class Secured:
    """The database the shapes run in, its request role, and a watching superuser session
    on every node opened before any shape runs."""

    def __init__(self, cluster: Cluster, role: str) -> None:
        self.cluster = cluster
        self.role = role
        self.nodes = {"coordinator": cluster.coordinator, "worker1": cluster.workers[0],
                      "worker2": cluster.workers[1]}
        self.watchers = {name: psycopg.connect(node.dsn(cluster.db), autocommit=True)
                         for name, node in self.nodes.items()}
        self.backend_pids = {name: self._backend_pid(name) for name in self.nodes}
        self.postmaster_pids = {name: self._postmaster_pid(name) for name in self.nodes}
        self.log_sizes = {name: self._log(name).stat().st_size for name in self.nodes}

    def _backend_pid(self, name: str) -> int:
        return self.watchers[name].execute("SELECT pg_backend_pid()").fetchone()[0]

    def _postmaster_pid(self, name: str) -> int:
        return int((self.nodes[name].datadir / "postmaster.pid").read_text().split()[0])

    def _log(self, name: str) -> Path:
        (log,) = self.nodes[name].tmpdir.glob("*.log")
        return log

    def crashes(self, name: str) -> list[str]:
        """Lines the node logged since the fixture started that report a crashed backend."""
        with self._log(name).open(errors="replace") as f:
            f.seek(self.log_sizes[name])
            return [line.strip() for line in f if "terminated by signal" in line]

    def assert_every_node_up(self) -> None:
        # A crash restart first ends every session, then refuses connections during crash
        # recovery: a new connection that succeeds means any restart has already cut the
        # watchers, so a watcher that still answers with its pid proves there was none.
        for node in self.nodes.values():
            with psycopg.connect(node.dsn(self.cluster.db), autocommit=True) as conn:
                conn.execute("SELECT 1")
        for name in self.nodes:
            assert self._backend_pid(name) == self.backend_pids[name], name
            assert self._postmaster_pid(name) == self.postmaster_pids[name], name
            assert self.crashes(name) == [], name

    def close(self) -> None:
        for conn in self.watchers.values():
            conn.close()
