"""The schema install as Django migration operations, built from the package's bundled SQL
(:func:`pg_idempotency.migrate.migrations`): one Django migration per bundled file.

Each operation does what :func:`pg_idempotency.migrate.migrate` does for its file, inside the
Django migration's transaction: take the installers' advisory lock, skip the file when
``idempotency.migrations`` already records its version (another tool -- psql, ``pg-idempotency
migrate`` -- applied it), else run it. ``sqlmigrate`` prints the lock and the file's SQL.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations as dj_migrations

from ..migrate import LOCK_KEY, RESTORE_SEARCH_PATH, SAVE_SEARCH_PATH, Migration, MigrationError
from ..migrate import migrations as bundled

# Constant statements; the version is a bound parameter.
_LOCK = f"SELECT pg_catalog.pg_advisory_xact_lock({int(LOCK_KEY)})"
_HAS_TABLE = "SELECT pg_catalog.to_regclass('idempotency.migrations') IS NOT NULL"
_RECORDED = "SELECT EXISTS (SELECT FROM idempotency.migrations WHERE version = %s::integer)"


def bundled_migration(name: str) -> Migration:
    for migration in bundled():
        if migration.name == name:
            return migration
    raise MigrationError(f"the pg_idempotency package has no bundled migration {name}")


class ApplyBundledMigration(dj_migrations.operations.base.Operation):
    """Apply the bundled ``migrations/<name>.sql`` unless its version is already recorded."""

    reversible = False
    reduces_to_sql = True

    def __init__(self, name: str) -> None:
        self.name = name

    def deconstruct(self) -> tuple[str, list[Any], dict[str, Any]]:
        return (self.__class__.__qualname__, [self.name], {})

    def state_forwards(self, app_label: str, state: Any) -> None:
        pass  # no Django models: the schema is the engine's

    def database_forwards(self, app_label: str, schema_editor: Any, from_state: Any,
                          to_state: Any) -> None:
        migration = bundled_migration(self.name)
        if schema_editor.collect_sql:  # sqlmigrate
            schema_editor.execute(_LOCK, params=None)
            _apply(schema_editor, migration)
            return
        with schema_editor.connection.cursor() as cursor:
            cursor.execute(_LOCK)
            if _is_applied(cursor, migration.version):
                return
        _apply(schema_editor, migration)
        with schema_editor.connection.cursor() as cursor:
            if not _is_applied(cursor, migration.version):
                raise MigrationError(f"migration {migration.name} did not record version "
                                     f"{migration.version} in idempotency.migrations")

    def database_backwards(self, app_label: str, schema_editor: Any, from_state: Any,
                           to_state: Any) -> None:
        raise dj_migrations.exceptions.IrreversibleError(
            f"pg_idempotency migration {self.name} cannot be undone (its keys are live data); "
            "drop the schema by hand if you mean it: DROP SCHEMA idempotency CASCADE")

    def describe(self) -> str:
        return f"Apply the bundled pg_idempotency migration {self.name}.sql"


def _apply(schema_editor: Any, migration: Migration) -> None:
    # Django records the migration in django_migrations in this transaction, and 0001-0009 pin
    # search_path until its end: the installer's is saved before the file and put back after it
    # (docs/install.md). params=None: the file goes as it is (one simple-protocol query; '%' is
    # not a placeholder).
    schema_editor.execute(SAVE_SEARCH_PATH, params=None)
    schema_editor.execute(migration.sql, params=None)
    schema_editor.execute(RESTORE_SEARCH_PATH, params=None)


def _is_applied(cursor: Any, version: int) -> bool:
    cursor.execute(_HAS_TABLE)
    if not cursor.fetchone()[0]:
        return False
    cursor.execute(_RECORDED, [version])
    return bool(cursor.fetchone()[0])
