"""Upgrading to Engine v2 (migration 0005, extension 0.5.0) with live keys.

An install at 0004 (by psql, or the extension at 0.4.0) gets real state through the old
functions: a completed key, an in-progress key whose lease expired, one whose lease is live, a
key dated weeks ahead (in keys_default), a key that maintain() dropped and kept as a tombstone,
and an inbox message. Then the upgrade runs (`pg-idempotency migrate`, or ALTER EXTENSION ...
UPDATE) and every one of those keys must behave as before: replay, resume after lease expiry with
a higher token, fencing of the old token, expired for the tombstone, false for a redelivery.
The schema of an upgraded install against a fresh one is compared by test_install.py.
"""

from __future__ import annotations

import subprocess
import sys

import psycopg
from helpers.install import (
    INSTALL_ARGS,
    MIGRATIONS,
    make_state,
    reinstall_this_build,
    scratch_db,
    walk,
)

from pgharness import WAIT_BOUND, PgServer


def test_migrate_0004_to_0005_with_live_keys(server: PgServer) -> None:
    old = [m for m in MIGRATIONS if int(m.name[:4]) <= 4]
    assert len(old) == 4
    with scratch_db(server, "up_psql") as db:
        for path in old:
            server.run_psql(db, path, args=INSTALL_ARGS)
        with psycopg.connect(db, autocommit=True) as conn:
            assert conn.execute("SELECT to_regclass('idempotency.key_directory')"
                                ).fetchone()[0] is None
            st = make_state(conn)
        proc = subprocess.run(
            [sys.executable, "-m", "pg_idempotency.cli", "migrate", "--dsn", db],
            capture_output=True, text=True, timeout=WAIT_BOUND, check=False)
        assert proc.returncode == 0, (proc.stdout, proc.stderr)
        assert "0005_directory" in proc.stdout + proc.stderr, proc.stdout
        with psycopg.connect(db, autocommit=True) as conn:
            assert conn.execute("SELECT max(version) FROM idempotency.migrations"
                                ).fetchone()[0] == len(MIGRATIONS)  # 0005 and later ones
            walk(conn, st)


def test_alter_extension_0_4_0_to_0_5_0_with_live_keys(server: PgServer) -> None:
    reinstall_this_build(server)
    with scratch_db(server, "up_ext") as db:
        with psycopg.connect(db, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION pg_idempotency VERSION '0.1.0'")
            conn.execute("ALTER EXTENSION pg_idempotency UPDATE TO '0.4.0'")
            st = make_state(conn)
            conn.execute("ALTER EXTENSION pg_idempotency UPDATE TO '0.5.0'")
            assert conn.execute("SELECT extversion FROM pg_extension "
                                "WHERE extname = 'pg_idempotency'").fetchone()[0] == "0.5.0"
            # The directory's partitions made by the update are not extension members (pg_dump
            # must dump their rows), its default partition is.
            members = dict(conn.execute(
                "SELECT c.relname, EXISTS (SELECT FROM pg_depend AS d WHERE d.objid = c.oid "
                "AND d.classid = 'pg_class'::regclass AND d.deptype = 'e') "
                "FROM pg_class AS c WHERE c.relname LIKE 'key_directory%' "
                "AND c.relkind IN ('r', 'p')").fetchall())
            assert members.pop("key_directory") and members.pop("key_directory_default")
            assert members and not any(members.values()), members
            walk(conn, st)
