"""Install and upgrade the ``idempotency`` schema from the migrations bundled in this package.

The SQL files are the same ``migrations/NNNN_name.sql`` files that ship in the repository; they
are plain SQL so that any tool can apply them (psql, Flyway, golang-migrate, Alembic). Each file
ends by inserting its own row into ``idempotency.migrations``, so the record of what is applied
is the same whichever tool applied it, and :func:`migrate` skips what another tool already did.

    >>> import psycopg
    >>> from pg_idempotency.migrate import migrate
    >>> with psycopg.connect(dsn) as conn:
    ...     migrate(conn)
    [1]

For another migration tool, :func:`install_sql` returns all migrations as one script,
:func:`migrations` returns them one by one (version, name, SQL), and :func:`sql_path` names the
folder that holds the files (``pg-idempotency sql-path`` prints it). A tool that goes on in the
same transaction after a file (Django's ``RunSQL``, Alembic) puts :data:`SAVE_SEARCH_PATH`
before it and :data:`RESTORE_SEARCH_PATH` after it: 0001-0009 pin ``search_path`` until the end
of the transaction (docs/install.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from importlib.abc import Traversable
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus

__all__ = ["LOCK_KEY", "RESTORE_SEARCH_PATH", "SAVE_SEARCH_PATH", "Migration", "MigrationError",
           "install_sql", "migrate", "migrations", "sql_path"]

#: Key of the transaction-scoped advisory lock every migration transaction takes first
#: (``pg_advisory_xact_lock(LOCK_KEY)``): the ASCII bytes ``idem_mig`` read as a big-endian
#: bigint, 7594306392080345447. Installers racing on one database queue on it, so the
#: first applies a migration and the others then find its version row and skip it.
LOCK_KEY = int.from_bytes(b"idem_mig", "big")

#: Run before a migration file in a transaction that goes on after it (docs/install.md): saves
#: the installer's ``search_path``, which migrations 0001-0009 pin to ``pg_catalog, pg_temp`` until
#: the end of the transaction (they were released so, and released files never change).
SAVE_SEARCH_PATH = (
    "SELECT set_config('idempotency.installer_search_path', current_setting('search_path'), "
    "true);\n"
)
#: Run after the file: puts the saved ``search_path`` back, local to the transaction, so the
#: tool's own statements (``django_migrations``, ``alembic_version``) find its tables. (From 0010
#: on a file does both itself; the pair around it is harmless.)
RESTORE_SEARCH_PATH = (
    "SELECT set_config('search_path', current_setting('idempotency.installer_search_path'), "
    "true);\n"
)

_FILE_RE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")

# Every statement is constant: the only value that varies (the version) is a bound parameter.
_LOCK = sql.SQL("SELECT pg_catalog.pg_advisory_xact_lock({})").format(sql.Literal(LOCK_KEY))
# The lock must be taken before this transaction's snapshot exists, or a loser of the race would
# not see the winner's commit: READ COMMITTED takes a new snapshot per statement.
_READ_COMMITTED = sql.SQL("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
_HAS_TABLE = sql.SQL("SELECT pg_catalog.to_regclass('idempotency.migrations') IS NOT NULL")
_HAS_VERSION = sql.SQL(
    "SELECT EXISTS (SELECT FROM idempotency.migrations WHERE version = %(version)s::integer)"
)


class MigrationError(Exception):
    """The bundled migrations are broken or the connection cannot be used to apply them."""


@dataclass(frozen=True)
class Migration:
    """One bundled migration file, ``NNNN_name.sql``."""

    version: int  #: NNNN as an integer (the ``idempotency.migrations.version`` it records)
    name: str  #: the file name without ``.sql``, e.g. ``0001_core``
    sql: str  #: the file's text, exactly as shipped

    @property
    def filename(self) -> str:
        return f"{self.name}.sql"


def _folder() -> Traversable:
    folder = resources.files("pg_idempotency").joinpath("migrations")
    if not folder.is_dir():
        raise MigrationError(
            "the pg_idempotency package has no bundled migrations/ directory "
            "(install the package, e.g. pip install . in the clone, rather than importing "
            "python/ from the source tree)"
        )
    return folder


def sql_path() -> Path:
    """The folder of the installed package's migration files (``NNNN_name.sql``), for a tool
    that reads them itself: Django ``RunSQL``, Alembic, Flyway, a psql loop (docs/install.md).
    The files are the package's own; read them, do not change them."""
    folder = _folder()
    if not isinstance(folder, Path):  # a zip import has no folder on disk
        raise MigrationError("the pg_idempotency package is not installed as files on disk; "
                             "use pg_idempotency.migrate.migrations() to read the SQL")
    return folder


def migrations() -> list[Migration]:
    """The bundled migrations in version order (numbered 0001, 0002, ... without gaps)."""
    folder = _folder()
    found: list[Migration] = []
    for entry in folder.iterdir():
        match = _FILE_RE.match(entry.name)
        if match is None:
            continue
        found.append(
            Migration(int(match.group(1)), entry.name[: -len(".sql")],
                      entry.read_text(encoding="utf-8"))
        )
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if versions != list(range(1, len(found) + 1)):
        raise MigrationError(f"bundled migrations must be numbered 1, 2, ... without gaps: "
                             f"{versions}")
    return found


def install_sql() -> str:
    """All bundled migrations in order, each between :data:`SAVE_SEARCH_PATH` and
    :data:`RESTORE_SEARCH_PATH`: one script for another migration tool.

    Run it in one transaction (``psql -X -1 -v ON_ERROR_STOP=1 -f install.sql``); whatever runs
    after it in that transaction has the installer's ``search_path``. It records its versions in
    ``idempotency.migrations``, so :func:`migrate` later applies only newer migrations. On a
    database where some migrations are already applied, apply the missing files from
    :func:`migrations` one by one instead.
    """
    return "".join(SAVE_SEARCH_PATH + m.sql + RESTORE_SEARCH_PATH for m in migrations())


def migrate(conn: psycopg.Connection) -> list[int]:
    """Apply the bundled migrations that ``conn``'s database lacks; return their versions.

    Each migration runs in its own transaction on ``conn``: take the advisory lock
    :data:`LOCK_KEY`, skip the migration if ``idempotency.migrations`` already records its
    version, else run its SQL (which inserts the version row), commit. So concurrent installers
    are serialized and all but one skip, re-running is a no-op, and migrations applied earlier
    by psql or another tool are recognised.

    ``conn`` must be idle (no transaction open): migrations commit, and a commit must not take
    the caller's own unfinished work with it. Its autocommit setting is left as it was. On an
    error the failing migration is rolled back, earlier ones stay committed, and the
    :class:`psycopg.Error` propagates.
    """
    status = conn.info.transaction_status
    if status != TransactionStatus.IDLE:
        raise MigrationError(
            f"migrate() needs an idle connection, this one is {status.name}: commit or roll "
            "back first (each migration commits on its own)"
        )
    applied: list[int] = []
    for migration in migrations():
        with conn.transaction():
            conn.execute(_READ_COMMITTED, prepare=False)
            conn.execute(_LOCK, prepare=False)
            if _is_applied(conn, migration.version):
                continue
            # No parameters: sent as one simple-protocol query, so the many statements of the
            # file run as they are (and '%' in it is not taken for a placeholder).
            conn.execute(sql.SQL(migration.sql), prepare=False)
            if not _is_applied(conn, migration.version):
                raise MigrationError(
                    f"migration {migration.name} did not record version {migration.version} "
                    "in idempotency.migrations; rolled back"
                )
        applied.append(migration.version)
    return applied


def _is_applied(conn: psycopg.Connection, version: int) -> bool:
    row = conn.execute(_HAS_TABLE, prepare=False).fetchone()
    if row is None or not row[0]:
        return False
    row = conn.execute(_HAS_VERSION, {"version": version}, prepare=False).fetchone()
    return bool(row and row[0])
