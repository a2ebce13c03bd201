"""Shared fixtures: one PostgreSQL 15 and one PostgreSQL 18 server per session (per worker
under pytest-xdist). Their code is in helpers/servers.py; what tests share besides fixtures is
in helpers/ (a test module imports from there, never from this file: tests/README.md).

``server`` is parametrized, so every test that uses it (directly or through ``db`` /
``template_dsn`` / ``empty_db``) runs once per server.  A test that exists for one
server only overrides it: ``@pytest.mark.parametrize("server", ["pg15"], indirect=True)``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


# -- layers and needs (tests/README.md) -------------------------------------------------------

TESTS = Path(__file__).resolve().parent
# Each folder of tests/ is a layer, and each of its tests carries the layer's marker.
LAYERS = ("unit", "sql", "server", "frameworks", "citus", "conformance", "probes", "release")
# The conformance runners' languages (a ``lang`` parameter) and the toolchain each needs.
LANG_NEEDS = {"java": "jvm", "go": "go", "ruby": "ruby", "node": "node"}
# A test module imports what it shares from helpers/ (or conformance/), never from another test
# module or a conftest.py: pytest imports each once under its own rules, a second import by
# name runs it again or finds another conftest.
_FORBIDDEN_IMPORT = re.compile(r"^\s*(?:from|import)\s+(test_\w+|conftest)\b", re.M)


def _layer(path: Path) -> str:
    parts = path.relative_to(TESTS).parts
    if len(parts) < 2 or parts[0] not in LAYERS:
        raise pytest.UsageError(
            f"{path}: a test module lives in one of the layer folders of tests/ "
            f"({', '.join(LAYERS)}); tests/README.md says which")
    return parts[0]


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test with its layer (its folder) and with what it needs that a laptop may
    lack: ``citus`` (it uses the Citus cluster), ``pg15`` (Debian's PostgreSQL 15: a ``server``
    or other parameter pg15), the runner's toolchain for a ``lang`` parameter. Needs that
    no fixture or parameter shows are marked in the test modules themselves."""
    checked: set[Path] = set()
    for item in items:
        path = Path(str(item.path))
        if path not in checked:
            checked.add(path)
            found = _FORBIDDEN_IMPORT.search(path.read_text(encoding="utf-8"))
            if found:
                raise pytest.UsageError(
                    f"{path} imports {found.group(1)}: shared code goes in tests/helpers/ "
                    "(tests/README.md)")
        item.add_marker(_layer(path))
        if "citus_cluster" in item.fixturenames:
            item.add_marker("citus")
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "pg15" in params.values():
            item.add_marker("pg15")
        lang = params.get("lang")
        if lang is not None:
            if lang not in LANG_NEEDS:
                raise pytest.UsageError(f"{item.nodeid}: no needs marker for language {lang!r} "
                                        "(tests/conftest.py LANG_NEEDS)")
            item.add_marker(LANG_NEEDS[lang])


# -- what a selection left out, said at the end ------------------------------------------------
# pytest counts deselected tests in its last line, but not under pytest-xdist, whose workers do
# the collecting. Each worker reports its count (the same in every worker) to the controller,
# and the summary says it, with the needs markers of what was left out.

NEEDS = ("pg15", "citus", "pgbouncer", "prometheus", "pg_cron", "pg_tle", "partman",
         "plpgsql_check", "jvm", "go", "ruby", "node")
_DESELECTED = "idem_deselected"
_DESELECTED_KEY = pytest.StashKey[dict[str, int]]()


def pytest_deselected(items: list[pytest.Item]) -> None:
    if not items:
        return
    counts = items[0].config.stash.setdefault(_DESELECTED_KEY, {})
    counts["total"] = counts.get("total", 0) + len(items)
    for item in items:
        for name in NEEDS:
            if item.get_closest_marker(name) is not None:
                counts[name] = counts.get(name, 0) + 1



def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker
        workeroutput[_DESELECTED] = session.config.stash.get(_DESELECTED_KEY, {})


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    counts = getattr(node, "workeroutput", {}).get(_DESELECTED)
    if counts:
        node.config.stash[_DESELECTED_KEY] = counts


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    counts = config.stash.get(_DESELECTED_KEY, {})
    if counts.get("total"):
        needs = ", ".join(f"{name} {counts[name]}" for name in NEEDS if counts.get(name))
        terminalreporter.write_line(
            f"deselected: {counts['total']} tests (by needs marker, a test may need several: "
            f"{needs or 'none'})", yellow=True)
