"""pg_dump / pg_restore of a migrations install with grants and completer scopes.

idempotency.grants records each role let in (a regrole: dumped by name) and
idempotency.completer_grants mirrors the completers among them by a trigger on grants. A restore
loads both tables as they were dumped (the trigger is made after the data, so it does not fire
during the load) and must leave:

- the request role able to claim, complete and replay, and nothing more (no table privilege);
- the completer limited to its scopes still limited: takeover / list_abandoned of another scope
  raise IK023 and change nothing, its own scope is taken over; the unlimited completer keeps
  every scope;
- the mirror live: a grant_usage() after the restore updates completer_grants.

The extension install's known restore limitation has its strict xfail in
tests/release/test_install.py; this file uses the migrations install, which restores with
--exit-on-error.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers import sqlstate
from psycopg import sql

from pgharness import PgServer

CLAIM_PAST = ("SELECT lease_token FROM idempotency.claim(%s, %s, '{}', lease => '1 second',"
              " reference_time => clock_timestamp() - interval '1 hour')")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env["LC_MESSAGES"] = "C"
    return env


def _run(server: PgServer, program: str, *args: str) -> None:
    proc = subprocess.run([str(server.bindir / program), *args], capture_output=True,
                          text=True, env=_env(), timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"{program} failed:\n{proc.stderr}"


def _admin(server: PgServer, statement: sql.Composable) -> None:
    with psycopg.connect(server.dsn("postgres"), autocommit=True) as conn:
        conn.execute(statement)


@pytest.fixture
def roles(server: PgServer) -> Iterator[dict[str, str]]:
    names = {kind: f"dr_{kind}_{uuid.uuid4().hex[:8]}"
             for kind in ("api", "limited", "worker", "later")}
    for name in names.values():
        _admin(server, sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
    try:
        yield names
    finally:
        for name in names.values():
            # (After the databases holding their privileges are dropped: see restored().)
            _admin(server, sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))


@pytest.fixture
def restored(server: PgServer, roles: dict[str, str], db: str, tmp_path: Path
             ) -> Iterator[tuple[str, str, str, str]]:
    """(source DSN, restored DSN, the limited completer's scope, another scope). The source
    has the grants and some keys; it was dumped with ``pg_dump -Fc`` and restored into a new
    database with ``pg_restore --exit-on-error``."""
    mine, other = f"s_{uuid.uuid4().hex[:6]}", f"o_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(db, autocommit=True) as owner:
        owner.execute("SELECT idempotency.grant_usage(%s)", (roles["api"],))
        owner.execute("SELECT idempotency.grant_usage(%s, kind => 'completer', scopes => %s)",
                      (roles["limited"], [mine]))
        owner.execute("SELECT idempotency.grant_usage(%s, kind => 'completer')",
                      (roles["worker"],))
        for scope in (mine, other):
            owner.execute(CLAIM_PAST, (scope, "abandoned"))
        token = owner.execute("SELECT lease_token FROM idempotency.claim(%s, 'done', '{}')",
                              (other,)).fetchone()[0]
        owner.execute("SELECT idempotency.complete(%s, 'done', %s, 201, '{\"secret\": 1}')",
                      (other, token))
    dump = tmp_path / "idem.dump"
    _run(server, "pg_dump", "-Fc", "-f", str(dump), "-d", db)
    name = f"restored_{uuid.uuid4().hex[:10]}"
    _admin(server, sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        _run(server, "pg_restore", "--exit-on-error", "-d", server.dsn(name), str(dump))
        yield db, server.dsn(name), mine, other
    finally:
        _admin(server, sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)")
               .format(sql.Identifier(name)))


def _grants(dsn: str) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    with psycopg.connect(dsn) as conn:
        return (conn.execute("SELECT grantee::text, kind, scopes FROM idempotency.grants "
                             "ORDER BY 1, 2").fetchall(),
                conn.execute("SELECT grantee::text, scopes FROM idempotency.completer_grants "
                             "ORDER BY 1").fetchall())


def _keys(conn: psycopg.Connection[Any], scope: str) -> list[tuple[Any, ...]]:
    return conn.execute("SELECT key, state, lease_token, lease_expires_at, attempts "
                        "FROM idempotency.keys WHERE scope = %s ORDER BY key", (scope,)
                        ).fetchall()


def test_grants_and_completer_scopes_survive_dump_and_restore(
        restored: tuple[str, str, str, str], roles: dict[str, str]) -> None:
    source, target, mine, other = restored
    grants, mirror = _grants(target)
    assert (grants, mirror) == _grants(source)
    assert mirror == sorted([(roles["limited"], [mine]), (roles["worker"], None)])
    assert (roles["api"], "request", None) in grants

    # The request role: a new key claimed, completed and replayed; a reused key 'mismatch';
    # no table privilege came back with the restore.
    with psycopg.connect(target, user=roles["api"], autocommit=True) as conn:
        outcome, token = conn.execute(
            "SELECT outcome, lease_token FROM idempotency.claim(%s, 'after', '{\"a\": 1}')",
            (mine,)).fetchone()
        assert outcome == "claimed"
        conn.execute("SELECT idempotency.complete(%s, 'after', %s, 201, '{\"id\": 1}')",
                     (mine, token))
        again = conn.execute("SELECT outcome, response_status, response_body FROM "
                             "idempotency.claim(%s, 'after', '{\"a\": 1}')", (mine,)).fetchone()
        assert again == ("replay", 201, {"id": 1})
        assert conn.execute("SELECT outcome FROM idempotency.claim(%s, 'after', '{\"a\": 2}')",
                            (mine,)).fetchone()[0] == "mismatch"
        assert sqlstate(conn, "SELECT count(*) FROM idempotency.keys",
                        (), savepoint=True) == "42501"
        assert sqlstate(conn, "SELECT * FROM idempotency.list_abandoned()",
                        (), savepoint=True) == "42501"

    # The limited completer: the other scope is refused (IK023) and left as it was.
    with psycopg.connect(target) as owner:
        before = _keys(owner, other)
    with psycopg.connect(target, user=roles["limited"], autocommit=True) as conn:
        for query, params in [
            ("SELECT * FROM idempotency.list_abandoned(10, scope => %s)", (other,)),
            ("SELECT * FROM idempotency.takeover(%s, 'abandoned')", (other,)),
            ("SELECT * FROM idempotency.takeover(%s, 'done')", (other,)),
        ]:
            assert sqlstate(conn, query, params, savepoint=True) == "IK023", query
        listed = conn.execute("SELECT scope, key FROM idempotency.list_abandoned(1000)"
                              ).fetchall()
        assert (mine, "abandoned") in listed and all(s != other for s, _ in listed), listed
        assert conn.execute("SELECT outcome FROM idempotency.takeover(%s, 'abandoned')",
                            (mine,)).fetchone()[0] == "resumed"
    with psycopg.connect(target) as owner:
        assert _keys(owner, other) == before

    # The completer without scopes keeps every scope.
    with psycopg.connect(target, user=roles["worker"], autocommit=True) as conn:
        taken = conn.execute("SELECT outcome, response_status FROM "
                             "idempotency.takeover(%s, 'abandoned')", (other,)).fetchone()
        assert taken == ("resumed", None)

    # The mirror is live in the restored database: a new completer grant reaches it, and
    # withdrawing the limited one (docs/install.md) removes its scopes.
    with psycopg.connect(target, autocommit=True) as owner:
        owner.execute("SELECT idempotency.grant_usage(%s, kind => 'completer', scopes => %s)",
                      (roles["later"], [other]))
        owner.execute("DELETE FROM idempotency.grants WHERE grantee = %s::regrole "
                      "AND kind = 'completer'", (roles["limited"],))
    assert _grants(target)[1] == sorted([(roles["later"], [other]), (roles["worker"], None)])
    with psycopg.connect(target, user=roles["later"], autocommit=True) as conn:
        assert sqlstate(conn, "SELECT * FROM idempotency.takeover(%s, 'x')",
                        (mine,), savepoint=True) == "IK023"
