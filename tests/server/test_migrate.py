"""pg_idempotency.migrate: bundled files, first install, re-run, 20 racing installers, psql."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import psycopg
import pytest
from psycopg.rows import dict_row

from pg_idempotency.migrate import (
    LOCK_KEY,
    RESTORE_SEARCH_PATH,
    SAVE_SEARCH_PATH,
    MigrationError,
    install_sql,
    migrate,
    migrations,
)
from pgharness import WAIT_BOUND, PgServer

ROOT = Path(__file__).resolve().parents[2]
REPO_MIGRATIONS = sorted((ROOT / "migrations").glob("*.sql"))
RACERS = 20


def version_rows(dsn: str) -> list[dict]:
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        return conn.execute(
            "SELECT version, name FROM idempotency.migrations ORDER BY version"
        ).fetchall()


def claim_works(dsn: str) -> None:
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        row = conn.execute(
            "SELECT * FROM idempotency.claim(scope => %s::text, key => %s::text,"
            " request => %s::jsonb)",
            ("test", uuid.uuid4().hex, '{"amount": 1}'),
        ).fetchone()
        conn.commit()
    assert row is not None
    assert row["outcome"] == "claimed", row


# -- no server needed -----------------------------------------------------------------------

def test_bundled_migrations_are_the_repository_files() -> None:
    bundled = migrations()
    assert [m.filename for m in bundled] == [p.name for p in REPO_MIGRATIONS]
    assert [m.version for m in bundled] == [int(p.name[:4]) for p in REPO_MIGRATIONS]
    for m, path in zip(bundled, REPO_MIGRATIONS, strict=True):
        assert m.sql == path.read_text(encoding="utf-8"), f"{m.filename} differs from the repo"


def test_install_sql_is_the_concatenation() -> None:
    assert install_sql() == "".join(SAVE_SEARCH_PATH + p.read_text(encoding="utf-8")
                                    + RESTORE_SEARCH_PATH for p in REPO_MIGRATIONS)


def test_lock_key_is_the_documented_constant() -> None:
    assert LOCK_KEY == int.from_bytes(b"idem_mig", "big") == 7594306392080345447


# -- on both servers ------------------------------------------------------------------------

def test_migrate_empty_db_then_no_op(empty_db: str) -> None:
    expected = [m.version for m in migrations()]
    with psycopg.connect(empty_db) as conn:
        assert migrate(conn) == expected
        schema = conn.execute(
            "SELECT to_regnamespace('idempotency') IS NOT NULL"
        ).fetchone()
        assert schema == (True,)
        conn.commit()
        assert migrate(conn) == []
    with psycopg.connect(empty_db, autocommit=True) as conn:
        assert migrate(conn) == []
    assert version_rows(empty_db) == [
        {"version": m.version, "name": m.name} for m in migrations()
    ]
    claim_works(empty_db)


def test_migrate_refuses_a_connection_inside_a_transaction(empty_db: str) -> None:
    with psycopg.connect(empty_db) as conn:
        conn.execute("SELECT 1")
        with pytest.raises(MigrationError, match="idle connection"):
            migrate(conn)
        conn.rollback()
        assert migrate(conn) == [m.version for m in migrations()]


def test_migrate_after_psql_is_a_no_op(server: PgServer, empty_db: str) -> None:
    for path in REPO_MIGRATIONS:
        server.run_psql(empty_db, path, args=("-X", "-1", "-v", "ON_ERROR_STOP=1"))
    before = version_rows(empty_db)
    with psycopg.connect(empty_db) as conn:
        assert migrate(conn) == []
    assert version_rows(empty_db) == before
    claim_works(empty_db)


def test_migrate_after_install_sql_is_a_no_op(server: PgServer, empty_db: str) -> None:
    # install_sql() in one transaction and then the tool's own statement: the installer's
    # search_path is back although 0001-0009 pin theirs to the end of the transaction.
    out = server.run_psql(empty_db, install_sql() + "SELECT 'after: ' || current_setting("
                          "'search_path');\n", args=("-X", "-1", "-q", "-v", "ON_ERROR_STOP=1",
                                                    "-c", "SET search_path = public")).stdout
    assert "after: public" in out, out[-2000:]
    with psycopg.connect(empty_db) as conn:
        assert migrate(conn) == []


def test_migrate_does_not_depend_on_the_session_isolation_level(empty_db: str) -> None:
    """A loser of the race must see the winner's commit even if the caller's default is
    REPEATABLE READ: migrate() sets READ COMMITTED before taking the lock."""
    with psycopg.connect(empty_db) as conn:
        conn.isolation_level = psycopg.IsolationLevel.SERIALIZABLE
        assert migrate(conn) == [m.version for m in migrations()]


@pytest.mark.parametrize(
    "isolation", [None, psycopg.IsolationLevel.REPEATABLE_READ], ids=["default", "repeatable_read"]
)
def test_concurrent_installers(empty_db: str, isolation: psycopg.IsolationLevel | None) -> None:
    barrier = threading.Barrier(RACERS, timeout=WAIT_BOUND)
    results: list[list[int]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def install() -> None:
        try:
            with psycopg.connect(empty_db) as conn:
                if isolation is not None:
                    conn.isolation_level = isolation
                barrier.wait()
                applied = migrate(conn)
            with lock:
                results.append(applied)
        except BaseException as exc:  # collected and asserted below
            with lock:
                errors.append(exc)

    threads = [threading.Thread(target=install) for _ in range(RACERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=WAIT_BOUND)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert len(results) == RACERS
    expected = [m.version for m in migrations()]
    # Each migration commits on its own, so with several of them two racers may share the work
    # (one applies 0001, another 0003): each version is applied by exactly one racer.
    assert sorted(v for applied in results for v in applied) == expected
    assert [r["version"] for r in version_rows(empty_db)] == expected
    claim_works(empty_db)
