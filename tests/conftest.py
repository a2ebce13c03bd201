"""Shared fixtures: one PostgreSQL 15 and one PostgreSQL 18 server per session (per worker
under pytest-xdist). Their code is in helpers/servers.py; what tests share besides fixtures is
in helpers/ (a test module imports from there, never from this file: tests/README.md).

``server`` is parametrized, so every test that uses it (directly or through ``db`` /
``template_dsn`` / ``empty_db``) runs once per server.  A test that exists for one
server only overrides it: ``@pytest.mark.parametrize("server", ["pg15"], indirect=True)``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from helpers import admin_execute
from helpers.servers import CITUS_FLAVOURS, FLAVOURS, TEMPLATE_DB, ServerPool
from psycopg import sql

from citus_cluster import CitusCluster
from pgharness import PgServer


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

