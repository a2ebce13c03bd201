"""Shared fixtures: one PostgreSQL 15 and one PostgreSQL 18 server per session (per worker
under pytest-xdist).

``server`` is parametrized, so every test that uses it (directly or through ``db`` /
``template_dsn`` / ``empty_db``) runs once per server.  A test that exists for one
server only overrides it: ``@pytest.mark.parametrize("server", ["pg15"], indirect=True)``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest
from psycopg import sql

from citus_cluster import CitusCluster
from pgharness import HarnessError, PgServer, flavour_bindir

ROOT = Path(__file__).resolve().parent.parent
BUILD_EXT = ROOT / "build" / "extension"
MIGRATIONS = ROOT / "migrations"
FLAVOURS = ["pg15", "pg18"]
# Citus 14.0.1 on the wheel's PG 18, Citus 13.2.2 on Debian's PG 15 (tools/build_citus.py).
CITUS_FLAVOURS = ["pg18", "pg15"]
TEMPLATE_DB = "idem_template"
# One transaction per file, stop at the first error: psql -X -1 -v ON_ERROR_STOP=1 -f FILE.
MIGRATION_PSQL_ARGS = ("-X", "-1", "-v", "ON_ERROR_STOP=1")
T = TypeVar("T")


def install_built_extension(server: PgServer) -> list[str]:
    """Copy ``build/extension/*`` into the server's extension dir.

    Older files of the same extensions that this build does not have are removed: a stale
    ``name--0.1--0.2.sql`` left by an earlier build would hide a missing upgrade script.
    Each file is written under a temporary name and renamed into place, so a CREATE
    EXTENSION running meanwhile (another pytest-xdist worker, another checkout: PG 15's
    directory is the system one) reads either the old file or the new one, never a part.
    """
    if not BUILD_EXT.is_dir():
        return []
    dest = server.extension_dir
    built = {src.name for src in BUILD_EXT.iterdir() if src.is_file()}
    for control in BUILD_EXT.glob("*.control"):
        for old in [*dest.glob(f"{control.stem}.control"), *dest.glob(f"{control.stem}--*")]:
            if old.name not in built:
                old.unlink(missing_ok=True)  # another worker may have removed it first
    copied = []
    for name in sorted(built):
        tmp = dest / f".{name}.{os.getpid()}.tmp"  # a name PostgreSQL never looks up
        shutil.copyfile(BUILD_EXT / name, tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest / name)
        copied.append(name)
    return copied


@contextlib.contextmanager
def login_roles(server: PgServer, db: str, *kinds: str) -> Iterator[list[str]]:
    """One LOGIN role per kind (``request`` or ``completer``), made as docs/install.md says,
    dropped afterwards."""
    roles = [f"{kind}_{uuid.uuid4().hex[:8]}" for kind in kinds]
    with psycopg.connect(db, autocommit=True) as conn:
        for role, kind in zip(roles, kinds, strict=True):
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
            conn.execute("SELECT idempotency.grant_usage(%s::regrole, kind => %s)", (role, kind))
    try:
        yield roles
    finally:
        with psycopg.connect(db, autocommit=True) as conn:
            for role in roles:
                conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        with psycopg.connect(server.dsn("postgres"), autocommit=True) as conn:
            for role in roles:
                conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def admin_execute(server: PgServer, query: sql.Composable | str) -> None:
    with psycopg.connect(server.dsn("postgres"), autocommit=True) as conn:
        conn.execute(query)


class ServerPool:
    """Starts each flavour at most once, on first use; stops all at session end."""

    def __init__(self) -> None:
        self._servers: list[PgServer] = []
        self._done: dict[tuple[str, str], tuple[bool, Any]] = {}
        self._ids = itertools.count(1)

    def get(self, flavour: str) -> PgServer:
        return self._once(("server", flavour), lambda: self._start(flavour))

    def template(self, flavour: str) -> str:
        """DSN of ``idem_template``: pgTAP plus ``migrations/*.sql`` applied by plain psql."""
        return self._once(("template", flavour), lambda: self._build_template(flavour))

    def _once(self, key: tuple[str, str], make: Callable[[], T]) -> T:
        """Run ``make`` once; later calls get its result, or the same failure again."""
        if key not in self._done:
            try:
                self._done[key] = (True, make())
            except Exception as exc:
                self._done[key] = (False, exc)
        ok, value = self._done[key]
        if not ok:
            raise HarnessError(f"{key[0]} {key[1]} could not be set up:\n{value}")
        return value

    def _start(self, flavour: str) -> PgServer:
        srv = PgServer(flavour_bindir(flavour), name=flavour)
        self._servers.append(srv)
        srv.start()  # raises HarnessError with the server log: a loud failure
        install_built_extension(srv)
        return srv

    def _build_template(self, flavour: str) -> str:
        srv = self.get(flavour)
        admin_execute(srv, sql.SQL("CREATE DATABASE {}").format(sql.Identifier(TEMPLATE_DB)))
        dsn = srv.dsn(TEMPLATE_DB)
        srv.run_psql(dsn, "CREATE EXTENSION pgtap;")
        for migration in sorted(MIGRATIONS.glob("*.sql")):
            # Exactly the install command documented in each migration's header.
            srv.run_psql(dsn, migration, args=MIGRATION_PSQL_ARGS)
        return dsn

    def new_db_name(self, prefix: str) -> str:
        return f"{prefix}_{next(self._ids)}_{uuid.uuid4().hex[:8]}"

    def stop_all(self) -> None:
        for srv in self._servers:
            srv.stop()
        self._servers.clear()
        self._done.clear()


@pytest.fixture(scope="session")
def server_pool() -> Iterator[ServerPool]:
    pool = ServerPool()
    try:
        yield pool
    finally:
        pool.stop_all()


@pytest.fixture(scope="session", params=FLAVOURS, ids=FLAVOURS)
def server(request: pytest.FixtureRequest, server_pool: ServerPool) -> PgServer:
    return server_pool.get(request.param)


@pytest.fixture(scope="session")
def template_dsn(server: PgServer, server_pool: ServerPool) -> str:
    return server_pool.template(server.name)


def _scratch_db(server: PgServer, name: str, template: str | None) -> Iterator[str]:
    create = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    if template is not None:
        create = sql.SQL("{} TEMPLATE {}").format(create, sql.Identifier(template))
    admin_execute(server, create)
    try:
        yield server.dsn(name)
    finally:
        admin_execute(
            server, sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


@pytest.fixture
def db(server: PgServer, template_dsn: str, server_pool: ServerPool) -> Iterator[str]:
    """DSN of a fresh clone of ``idem_template`` (pgTAP + migrations), dropped afterwards."""
    yield from _scratch_db(server, server_pool.new_db_name("t"), TEMPLATE_DB)


@pytest.fixture
def empty_db(server: PgServer, server_pool: ServerPool) -> Iterator[str]:
    """DSN of a brand-new empty database, dropped afterwards."""
    yield from _scratch_db(server, server_pool.new_db_name("e"), None)


@pytest.fixture(scope="session", params=CITUS_FLAVOURS, ids=[f"citus-{f}" for f in CITUS_FLAVOURS])
def citus_cluster(request: pytest.FixtureRequest) -> Iterator[CitusCluster]:
    """A started coordinator + 2 workers (:class:`citus_cluster.CitusCluster`), once per
    flavour; a missing Citus build fails every test that uses it."""
    cluster = CitusCluster(request.param)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture
def citus_db(citus_cluster: CitusCluster, server_pool: ServerPool) -> Iterator[str]:
    """Coordinator DSN of a fresh database with citus on every node and the workers
    registered; dropped on all nodes afterwards."""
    name = server_pool.new_db_name("c")
    try:
        yield citus_cluster.create_database(name)
    finally:
        citus_cluster.drop_database(name)


@pytest.fixture
def anyio_backend() -> str:
    """Async tests (``@pytest.mark.anyio``) run on asyncio only."""
    return "asyncio"
