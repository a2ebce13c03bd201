"""A throwaway Citus cluster: a coordinator and two workers on loopback.

Usable from pytest (the ``citus_cluster`` fixture in conftest.py) and from scripts::

    from citus_cluster import CitusCluster
    with CitusCluster("pg18") as cluster:
        dsn = cluster.create_database("app")   # coordinator DSN; citus on every node
        cluster.workers[0].dsn("app")          # a worker's DSN for the same database

Citus keeps its metadata per database, so :meth:`CitusCluster.create_database` creates the
database on every node, runs ``CREATE EXTENSION citus`` in each and registers the
coordinator and the workers in it.  Citus itself is built and installed into the server
trees by ``make setup`` (tools/build_citus.py); when it is missing the cluster refuses to
start with a message saying why, so the tests that need it fail.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from pathlib import Path

import psycopg
from psycopg import sql

from pgharness import HarnessError, PgServer, flavour_bindir

# The Citus release each flavour is built with (tools/build_citus.py).
CITUS_VERSION = {"pg18": "14.0.1", "pg15": "13.2.2"}
CITUS_SETTINGS: dict[str, object] = {
    "shared_preload_libraries": "citus",
    # Citus commits multi-node transactions with two-phase commit.
    "max_prepared_transactions": "100",
    # citus_move_shard_placement copies shards with logical replication.
    "wal_level": "logical",
    # Loopback only: no TLS between nodes (libpq would otherwise look for client
    # certificates in the server user's home).
    "citus.node_conninfo": "sslmode=disable",
}


def _server_settings(bindir: Path) -> set[str]:
    """The settings this server build knows (``postgres --describe-config``: no data
    directory needed)."""
    out = subprocess.run([str(bindir / "postgres"), "--describe-config"], check=True,
                         capture_output=True, text=True).stdout
    return {line.split("\t", 1)[0] for line in out.splitlines()}


def _version_settings(bindir: Path) -> dict[str, object]:
    """Settings only some server builds have. PostgreSQL 18.6 (the wheel's) lets logical
    decoding use only the plugins of ``output_plugin_libraries`` ('pgoutput, test_decoding' by
    default); Citus decodes with its own plugin for a logical shard move or split, which
    failed with 'library "citus" may not be used as an output plugin' (docs/scale-out.md)."""
    if "output_plugin_libraries" in _server_settings(bindir):
        return {"output_plugin_libraries": "pgoutput, test_decoding, citus"}
    return {}


class CitusCluster:
    """``workers`` Citus workers plus a coordinator, each its own :class:`PgServer`."""

    def __init__(self, flavour: str, *, workers: int = 2,
                 extra_conf: Mapping[str, object] | None = None) -> None:
        self.flavour = flavour
        bindir = flavour_bindir(flavour)
        conf = {**CITUS_SETTINGS, **_version_settings(bindir), **(extra_conf or {})}
        self.coordinator = PgServer(bindir, extra_conf=conf, name=f"{flavour}-coord")
        self.workers = [PgServer(bindir, extra_conf=conf, name=f"{flavour}-worker{i + 1}")
                        for i in range(workers)]
        self.databases: list[str] = []

    @property
    def nodes(self) -> list[PgServer]:
        return [self.coordinator, *self.workers]

    def _check_installed(self) -> None:
        control = self.coordinator.extension_dir / "citus.control"
        if not control.is_file():
            raise HarnessError(
                f"Citus is not installed for {self.flavour} ({control} missing): `make setup` "
                f"builds Citus {CITUS_VERSION.get(self.flavour, '?')} from ../shared/citus/ "
                "(tools/build_citus.py); without the sources there the Citus tests fail"
            )

    def start(self) -> CitusCluster:
        self._check_installed()
        try:
            for node in self.nodes:
                node.start()
        except BaseException:
            self.stop()
            raise
        return self

    def create_database(self, name: str) -> str:
        """Create ``name`` on every node with citus installed and the nodes registered;
        returns the coordinator's DSN for it."""
        for node in self.nodes:
            with psycopg.connect(node.dsn("postgres"), autocommit=True) as conn:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            with psycopg.connect(node.dsn(name), autocommit=True) as conn:
                conn.execute("CREATE EXTENSION citus")
        self.databases.append(name)
        with psycopg.connect(self.coordinator.dsn(name), autocommit=True) as conn:
            conn.execute("SELECT citus_set_coordinator_host('127.0.0.1', %s)",
                         (self.coordinator.port,))
            for worker in self.workers:
                conn.execute("SELECT citus_add_node('127.0.0.1', %s)", (worker.port,))
        return self.coordinator.dsn(name)

    def drop_database(self, name: str) -> None:
        for node in self.nodes:
            with psycopg.connect(node.dsn("postgres"), autocommit=True) as conn:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)")
                             .format(sql.Identifier(name)))
        if name in self.databases:
            self.databases.remove(name)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        self.databases.clear()

    def __enter__(self) -> CitusCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
