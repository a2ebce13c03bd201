"""What test modules share: import it from here (``from helpers import login_roles``), never from
another test module or from a conftest.py.

tests/ is on pytest's pythonpath (pyproject.toml), so ``helpers`` and ``conformance`` import the
same way from every folder. The package's modules, by what they serve:

- ``helpers`` (this file): the checkout's paths, the migrations' psql arguments, roles,
  SQLSTATEs and the docs' fenced blocks: what any test against a server needs;
- ``helpers.servers``: the session's servers (``ServerPool``, the flavours, installing
  build/extension/), used by tests/conftest.py's fixtures;
- ``helpers.install``: scratch databases, pg_dump, the built extension put back, upgrade states;
- ``helpers.citus``: a distributed install on the session's Citus cluster, and counting the
  worker sessions a call opens;
- ``helpers.http``: the example payments app, uvicorn and WSGI servers, the Django example set
  up, the same HTTP app behind every adapter;
- ``helpers.served``: every adapter under gunicorn (sync, gthread), waitress, werkzeug's server
  and uvicorn, and a raw-socket client;
- ``helpers.probes``: hostile session settings and the timing oracle's keys and judge;
- ``helpers.api``: the sync/async API runner and the console script;
- ``helpers.sa_engines``: SQLAlchemy engines on each driver pg_idempotency.sqlalchemy is tested
  with (psycopg, pg8000, asyncpg; psycopg's statements direct or through ``text()``).
"""

from __future__ import annotations

import contextlib
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from pgharness import PgServer

ROOT = Path(__file__).resolve().parents[2]
BUILD_EXT = ROOT / "build" / "extension"
MIGRATIONS = ROOT / "migrations"
# One transaction per file, stop at the first error: psql -X -1 -v ON_ERROR_STOP=1 -f FILE.
MIGRATION_PSQL_ARGS = ("-X", "-1", "-v", "ON_ERROR_STOP=1")
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```[ \t]*$", re.M | re.S)


def doc_block(page: str, lang: str, starting: str) -> str:
    """The one fenced block of docs/``page`` in ``lang`` that starts with ``starting``: the
    tests run the docs' examples as written."""
    found = [m.group(2) for m in _FENCE.finditer((ROOT / "docs" / page).read_text())
             if m.group(1) == lang and m.group(2).startswith(starting)]
    assert len(found) == 1, f"docs/{page}: {len(found)} ```{lang} blocks with {starting!r}"
    return found[0]


def sqlstate(target: psycopg.Connection[Any] | str, query: str, params: Any = None, *,
             savepoint: bool = False) -> str | None:
    """The SQLSTATE ``query`` raises, or None when it succeeds.

    ``target`` is a connection, or a DSN to open an autocommit connection on (closed after).
    With ``savepoint``, the query runs in ``conn.transaction()`` (a savepoint inside an open
    transaction, which then survives the error) and its rows are read too; without, it is one
    plain execute, nothing added around it (on Citus a BEGIN would change what is measured)."""
    if isinstance(target, str):
        with psycopg.connect(target, autocommit=True) as conn:
            return sqlstate(conn, query, params, savepoint=savepoint)
    try:
        if savepoint:
            with target.transaction():
                target.execute(query, params).fetchall()
        else:
            target.execute(query, params)
    except psycopg.Error as exc:
        return exc.sqlstate
    return None


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
