"""Installs outside the template: scratch databases, pg_dump, this build's extension files put
back, and the upgrade states (tests/release/, tests/sql/test_routes.py, tests/probes/)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.types.json import Jsonb

from helpers import ROOT
from helpers.servers import install_built_extension
from pgharness import WAIT_BOUND, PgServer

# The migration files, in order (helpers.MIGRATIONS is their directory).
MIGRATIONS = sorted((ROOT / "migrations").glob("*.sql"))

INSTALL_ARGS = ("-X", "-v", "ON_ERROR_STOP=1", "-1")
# claim() with a reference time, as the upgrade states are made and walked.
CLAIM = ("SELECT outcome, lease_token, response_body, created_at "
         "FROM idempotency.claim(%s, %s, %s, reference_time => %s)")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env["LC_MESSAGES"] = "C"
    return env


def pg_dump(server: PgServer, dsn: str, *args: str) -> str:
    """Run the server's own pg_dump (same major version as the server)."""
    proc = subprocess.run([str(server.bindir / "pg_dump"), *args, "-d", dsn],
                          capture_output=True, text=True, env=_env(), timeout=WAIT_BOUND)
    assert proc.returncode == 0, f"pg_dump failed:\n{proc.stderr}"
    return proc.stdout


def normalize_dump(text: str) -> str:
    """Drop what differs between two dumps of the same schema: the per-dump random key of
    \\restrict / \\unrestrict (pg_dump 18, 17.6, 16.10, 15.14 and later)."""
    return "\n".join(line for line in text.splitlines()
                     if not re.match(r"^\\(un)?restrict ", line))


@contextlib.contextmanager
def scratch_db(server: PgServer, prefix: str) -> Iterator[str]:
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(server.dsn("postgres"), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield server.dsn(name)
    finally:
        with psycopg.connect(server.dsn("postgres"), autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)")
                         .format(sql.Identifier(name)))


def reinstall_this_build(server: PgServer) -> None:
    """Copy this checkout's build/extension/ into the server's extension directory again.

    PostgreSQL 15's is the system one, shared with any other checkout running its tests on
    this machine, so tests that create the extension put this build's files back first."""
    install_built_extension(server)


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


def executable(conn: psycopg.Connection[Any]) -> set[str]:
    return {r[0] for r in conn.execute(
        "SELECT p.proname FROM pg_proc AS p WHERE p.pronamespace = 'idempotency'::regnamespace "
        "AND has_function_privilege(p.oid, 'EXECUTE')").fetchall()}


def latest_extension_version() -> str:
    """default_version of the control file tools/build.py made (the newest migration's)."""
    control = (ROOT / "build" / "extension" / "pg_idempotency.control").read_text()
    return re.search(r"^default_version = '([^']+)'", control, re.M).group(1)
