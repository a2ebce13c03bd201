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
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb
from test_install import INSTALL_ARGS, MIGRATIONS, reinstall_this_build, scratch_db

from pgharness import WAIT_BOUND, PgServer

CLAIM = ("SELECT outcome, lease_token, response_body, created_at "
         "FROM idempotency.claim(%s, %s, %s, reference_time => %s)")


def make_state(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    """Keys of every kind, made by the functions of 0004."""
    now = conn.execute("SELECT date_trunc('second', clock_timestamp())").fetchone()[0]
    conn.execute("SELECT idempotency._premake(%s)", (now - timedelta(days=3),))
    conn.execute("SELECT idempotency._premake(%s)", (now,))
    conn.execute("UPDATE idempotency.settings SET tombstones = true")
    st: dict[str, Any] = {"now": now}
    # Dropped after its retention, with a tombstone.
    _, token, _, _ = conn.execute(CLAIM, ("up", "gone", Jsonb({"n": 0}),
                                          now - timedelta(days=3))).fetchone()
    conn.execute("SELECT idempotency.complete('up', 'gone', %s, 201, '{\"id\": 0}', "
                 "reference_time => %s)", (token, now - timedelta(days=3)))
    steps = conn.execute("SELECT action, parent_table FROM idempotency.maintain(%s)",
                         (now,)).fetchall()
    assert ("tombstoned", "keys") in steps and ("dropped", "keys") in steps, steps
    # Completed.
    _, token, _, st["done_created"] = conn.execute(
        CLAIM, ("up", "done", Jsonb({"n": 1}), now - timedelta(minutes=5))).fetchone()
    conn.execute("SELECT idempotency.complete('up', 'done', %s, 201, '{\"id\": 1}', "
                 "reference_time => %s)", (token, now - timedelta(minutes=5)))
    # In progress, its lease (30 s) long expired: the next claim resumes it.
    st["stale"] = conn.execute(CLAIM, ("up", "stale", Jsonb({"n": 2}),
                                       now - timedelta(minutes=10))).fetchone()[1]
    conn.execute("SELECT idempotency.checkpoint('up', 'stale', %s, 'charged', "
                 "reference_time => %s)", (st["stale"], now - timedelta(minutes=10)))
    # In progress under a live lease of a day.
    st["live"] = conn.execute(
        "SELECT lease_token FROM idempotency.claim('up', 'live', '{\"n\": 3}', "
        "lease => '1 day', reference_time => %s)", (now,)).fetchone()[0]
    # Dated 20 days ahead: beyond the partitions made ahead, so in keys_default.
    st["ahead"] = conn.execute(CLAIM, ("up", "ahead", Jsonb({"n": 4}),
                                       now + timedelta(days=20))).fetchone()[1]
    assert conn.execute("SELECT tableoid::regclass::text FROM idempotency.keys "
                        "WHERE key = 'ahead'").fetchone()[0] == "idempotency.keys_default"
    assert conn.execute("SELECT idempotency.inbox_accept('up', 'm1')").fetchone()[0] is True
    st["keys"] = conn.execute("SELECT count(*) FROM idempotency.keys").fetchone()[0]
    assert st["keys"] == 4
    return st


def walk(conn: psycopg.Connection[Any], st: dict[str, Any]) -> None:
    """After the upgrade: every key made before it behaves as before."""
    now = st["now"]
    # One directory row per key, plus the tombstone's and, from 0009 (0.9.0) on, where the
    # inbox keeps its messages there too, the inbox message's.
    inbox_rows = conn.execute(
        "SELECT count(*) FROM idempotency.inbox AS i JOIN idempotency.key_directory AS d "
        "ON d.scope = i.consumer "
        "AND d.key_hash = sha256(convert_to(chr(31) || i.message_id, 'UTF8'))").fetchone()[0]
    assert inbox_rows == (1 if conn.execute(
        "SELECT to_regprocedure('idempotency._new_token(bigint)') IS NOT NULL").fetchone()[0]
        else 0)
    assert conn.execute("SELECT count(*) FROM idempotency.key_directory").fetchone()[0] == (
        st["keys"] + 1 + inbox_rows)
    assert conn.execute(
        "SELECT count(*) FROM idempotency.keys AS k JOIN idempotency.key_directory AS d "
        "ON d.scope = k.scope AND d.key_hash = sha256(convert_to(k.key, 'UTF8')) "
        "AND d.created_at = k.created_at").fetchone()[0] == st["keys"]
    # Replay, with the body and created_at stored before.
    outcome, token, body, created = conn.execute(
        CLAIM, ("up", "done", Jsonb({"n": 1}), now)).fetchone()
    assert (outcome, token, body, created) == ("replay", None, {"id": 1}, st["done_created"])
    assert conn.execute(CLAIM, ("up", "done", Jsonb({"n": 9}), now)).fetchone()[0] == "mismatch"
    # Resume after lease expiry, under a higher token, from the recovery point.
    row = conn.execute("SELECT outcome, lease_token, recovery_point, attempts "
                       "FROM idempotency.claim('up', 'stale', '{\"n\": 2}', "
                       "reference_time => %s)", (now,)).fetchone()
    assert row[0] == "resumed" and row[1] > st["stale"] and row[2:] == ("charged", 2), row
    new_token = row[1]
    # Fencing: the old holder's token is refused, the new one completes.
    with pytest.raises(psycopg.Error) as info:
        conn.execute("SELECT idempotency.complete('up', 'stale', %s, 200, '{}')", (st["stale"],))
    assert info.value.sqlstate == "IK001"
    conn.execute("SELECT idempotency.complete('up', 'stale', %s, 200, '{\"ok\": 1}')",
                 (new_token,))
    assert conn.execute(CLAIM, ("up", "stale", Jsonb({"n": 2}), now)).fetchone()[:3] == (
        "replay", None, {"ok": 1})
    # The live lease is still held: others see in_progress; its holder heartbeats, completes.
    assert conn.execute(CLAIM, ("up", "live", Jsonb({"n": 3}), now)).fetchone()[0] == (
        "in_progress")
    conn.execute("SELECT idempotency.heartbeat('up', 'live', %s)", (st["live"],))
    conn.execute("SELECT idempotency.complete('up', 'live', %s, 201, '{}')", (st["live"],))
    # The key in keys_default is found too, and its holder releases it.
    assert conn.execute(CLAIM, ("up", "ahead", Jsonb({"n": 4}), now + timedelta(days=20))
                        ).fetchone()[0] == "in_progress"
    conn.execute("SELECT idempotency.release('up', 'ahead', %s)", (st["ahead"],))
    again = conn.execute(CLAIM, ("up", "ahead", Jsonb({"n": 4}), now)).fetchone()
    assert again[0] == "claimed" and again[1] > st["ahead"]
    # The tombstone still answers expired; the inbox remembers its message.
    assert conn.execute(CLAIM, ("up", "gone", Jsonb({"n": 0}), now)).fetchone()[0] == "expired"
    assert conn.execute("SELECT idempotency.inbox_accept('up', 'm1')").fetchone()[0] is False
    # New keys, and maintenance, work on the new layout.
    assert conn.execute(CLAIM, ("up", "new", Jsonb({}), now)).fetchone()[0] == "claimed"
    assert conn.execute("SELECT count(*) FROM idempotency.maintain() WHERE action = 'skipped'"
                        ).fetchone()[0] == 0
    assert conn.execute(
        "SELECT count(*) FROM idempotency.keys GROUP BY scope, key HAVING count(*) > 1"
    ).fetchall() == []


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
