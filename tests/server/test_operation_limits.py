"""operation()'s own bounds (issue 34), as the roles docs/install.md sets up:

- ``op.complete()`` with a body (JSON serialized, or bytes) over ``max_response_bytes`` or
  headers over ``max_headers_bytes`` raises ArgumentTooLarge (IK018, naming the argument, the
  size and the limit) before anything is sent: the business transaction rolls back and the key
  is released (nothing half-stored: no business row, the key's row ``released``), sync, async
  and through a SQLAlchemy session; at the limit it is stored; the limits are operation()'s
  arguments and default to the server's (1 MiB, 16 KiB). A caller that catches the error
  cannot then commit its writes with another answer;
- a completer limited to some scopes gets :class:`pg_idempotency.ScopeNotGranted` (IK023) from
  takeover() and list_abandoned() for another scope, sync and async, and from the package's
  job runner's takeover.

The small limits used here (a few hundred bytes) are far below the smallest the server allows
(64 KiB, 4 KiB), so an IK018 seen here can only be the package's: the server would store these.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from helpers import login_roles
from psycopg import sql
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

import pg_idempotency as idem
from pg_idempotency import aio, core
from pg_idempotency import sqlalchemy as pg_sa
from pg_idempotency.errors import ArgumentTooLarge, ScopeNotGranted, UsageError
from pgharness import PgServer

LIMIT = 300
HEADERS_LIMIT = 120


@pytest.fixture
def app_dsn(server: PgServer, db: str) -> Iterator[str]:
    """A request role's DSN, with INSERT on a ledger table the owner made."""
    with login_roles(server, db, "request") as (role,):
        with psycopg.connect(db, autocommit=True) as owner:
            owner.execute("CREATE TABLE ledger (intent text NOT NULL)")
            owner.execute(sql.SQL("GRANT SELECT, INSERT ON ledger TO {}").format(
                sql.Identifier(role)))
        yield psycopg.conninfo.make_conninfo(db, user=role)


def sa_url(dsn: str) -> str:
    return "postgresql+psycopg://" + dsn.split("://", 1)[1]


def state(db: str, key: str) -> tuple[str, int | None] | None:
    with psycopg.connect(db) as conn:
        row = conn.execute("SELECT state::text, response_status FROM idempotency.keys "
                           "WHERE key = %s", (key,)).fetchone()
    return None if row is None else (row[0], row[1])


def ledger(db: str, intent: str) -> int:
    with psycopg.connect(db) as conn:
        return conn.execute("SELECT count(*) FROM ledger WHERE intent = %s",  # type: ignore[index]
                            (intent,)).fetchone()[0]


def json_of(size: int) -> dict[str, str]:
    """A JSON value whose stored bytes (compact) are ``size`` long."""
    value = {"pad": ""}
    value["pad"] = "x" * (size - len(core.json_bytes(value)))
    assert len(core.json_bytes(value)) == size
    return value


def test_complete_over_the_limits_raises_before_sending_and_releases(db: str,
                                                                      app_dsn: str) -> None:
    limits = {"max_response_bytes": LIMIT, "max_headers_bytes": HEADERS_LIMIT}
    over_headers = {"Location": "/p/" + "h" * HEADERS_LIMIT}
    cases = [("bytes", b"b" * (LIMIT + 1), None, "body", "idempotency.complete_bytes"),
             ("json", json_of(LIMIT + 1), None, "body", "idempotency.complete_bytes"),
             ("headers", {"ok": 1}, over_headers, "headers", "idempotency.complete_bytes"),
             ("no-body-headers", None, over_headers, "headers", "idempotency.complete")]
    with psycopg.connect(app_dsn) as conn:
        for key, body, headers, argument, function in cases:
            with pytest.raises(ArgumentTooLarge) as caught, \
                    idem.operation(conn, "acct", key, {"k": key}, **limits) as op:
                conn.execute("INSERT INTO ledger VALUES (%s)", (key,))
                op.complete(201, body, headers=headers)
            error = caught.value
            assert (error.sqlstate, error.argument, error.function) == \
                ("IK018", argument, function), key
            limit = LIMIT if argument == "body" else HEADERS_LIMIT
            assert f"the limit (max_{'response' if argument == 'body' else 'headers'}_bytes " \
                   f"of operation()) is {limit} bytes" in (error.detail or ""), error.detail
            assert isinstance(error, idem.InvalidArgument) and isinstance(error, ValueError)
            assert state(db, key) == ("released", None) and ledger(db, key) == 0, key
            assert op.released
        # at the limits: stored, and replayed as stored
        at_headers = {"Location": "/p/" + "h" * (HEADERS_LIMIT - len('{"Location":"/p/"}'))}
        assert len(idem.canonical_json(at_headers).encode()) == HEADERS_LIMIT
        for key, body in (("at-bytes", b"b" * LIMIT), ("at-json", json_of(LIMIT))):
            with idem.operation(conn, "acct", key, {"k": key}, **limits) as op:
                conn.execute("INSERT INTO ledger VALUES (%s)", (key,))
                op.complete(201, body, headers=at_headers)
            assert state(db, key) == ("completed", 201) and ledger(db, key) == 1
        with idem.operation(conn, "acct", "at-json", {"k": "at-json"}, **limits) as op:
            assert op.replay is not None and op.replay.json() == json_of(LIMIT)
        # a caller that catches the error cannot commit its writes with another answer
        with idem.operation(conn, "acct", "caught", {"k": 1}, **limits) as op:
            conn.execute("INSERT INTO ledger VALUES ('caught')")
            with pytest.raises(ArgumentTooLarge):
                op.complete(201, b"c" * (LIMIT + 1))
            with pytest.raises(UsageError, match="released"):
                op.complete(500, {"error": "too large"})
        assert state(db, "caught") == ("released", None) and ledger(db, "caught") == 0
        # the retry with the same key runs afresh and may store a smaller answer
        with idem.operation(conn, "acct", "bytes", {"k": "bytes"}, **limits) as op:
            assert op.outcome is idem.Outcome.CLAIMED
            conn.execute("INSERT INTO ledger VALUES ('bytes')")
            op.complete(201, b"small")
        assert state(db, "bytes") == ("completed", 201) and ledger(db, "bytes") == 1
        # after a checkpoint (a side effect may have happened) the key stays in progress,
        # the checkpoint's writes stay, the rest rolls back; nothing of the answer is stored
        with pytest.raises(ArgumentTooLarge), \
                idem.operation(conn, "acct", "cp", {"k": "cp"}, **limits) as op:
            conn.execute("INSERT INTO ledger VALUES ('cp')")
            op.checkpoint("charged")
            conn.execute("INSERT INTO ledger VALUES ('cp-after')")
            op.complete(201, b"c" * (LIMIT + 1))
        assert state(db, "cp") == ("in_progress", None)
        assert ledger(db, "cp") == 1 and ledger(db, "cp-after") == 0
        # the defaults are the server's: 1 MiB of body, 16 KiB of headers
        with pytest.raises(ArgumentTooLarge) as caught, \
                idem.operation(conn, "acct", "default", {"k": 2}) as op:
            op.complete(201, b"d" * (core.DEFAULT_MAX_RESPONSE_BYTES + 1))
        assert "is 1048576 bytes" in (caught.value.detail or "")
        with pytest.raises(ArgumentTooLarge) as caught, \
                idem.operation(conn, "acct", "default", {"k": 2}) as op:
            op.complete(201, {"ok": 1}, headers={"X-Big": "v" * 16384})
        assert caught.value.argument == "headers" and state(db, "default") == \
            ("released", None)
        with idem.operation(conn, "acct", "default", {"k": 2}) as op:
            op.complete(201, b"d" * core.DEFAULT_MAX_RESPONSE_BYTES)
        assert state(db, "default") == ("completed", 201)
    with pytest.raises(UsageError, match="max_response_bytes"):
        idem.operation(conn, "acct", "x", max_response_bytes=0)


def test_complete_over_the_limit_async_and_sqlalchemy(db: str, app_dsn: str) -> None:
    async def run() -> None:
        async with await psycopg.AsyncConnection.connect(app_dsn) as conn:
            with pytest.raises(ArgumentTooLarge) as caught:
                async with aio.operation(conn, "acct", "async", {"a": 1},
                                         max_response_bytes=LIMIT) as op:
                    await conn.execute("INSERT INTO ledger VALUES ('async')")
                    await op.complete(201, json_of(LIMIT + 1))
            assert caught.value.argument == "body"
            async with aio.operation(conn, "acct", "async-at", {"a": 1},
                                     max_response_bytes=LIMIT) as op:
                await conn.execute("INSERT INTO ledger VALUES ('async-at')")
                await op.complete(201, json_of(LIMIT))

    asyncio.run(run())
    assert state(db, "async") == ("released", None) and ledger(db, "async") == 0
    assert state(db, "async-at") == ("completed", 201) and ledger(db, "async-at") == 1

    engine = create_engine(sa_url(db), connect_args={"user": psycopg.conninfo.conninfo_to_dict(
        app_dsn)["user"]})
    try:
        with Session(engine) as session:
            with pytest.raises(ArgumentTooLarge), \
                    pg_sa.operation(session, "acct", "orm", {"a": 1},
                                    max_response_bytes=LIMIT) as op:
                session.execute(text("INSERT INTO ledger VALUES ('orm')"))
                op.complete(201, b"o" * (LIMIT + 1))
            assert not session.in_transaction()
    finally:
        engine.dispose()
    assert state(db, "orm") == ("released", None) and ledger(db, "orm") == 0


# -- IK023: a completer limited to its scopes --------------------------------------------------

def test_scope_not_granted_is_raised_for_a_foreign_scope(server: PgServer, db: str) -> None:
    role = f"completer_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(db, autocommit=True) as owner:
        owner.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        owner.execute("SELECT idempotency.grant_usage(%s::regrole, 'completer', ARRAY['mine'])",
                      (role,))
        for scope in ("mine", "theirs"):  # abandoned an hour ago
            owner.execute("SELECT idempotency.claim(%s, 'k', '{}', lease => '1 second', "
                          "reference_time => clock_timestamp() - interval '1 hour')", (scope,))
    def foreign() -> list[tuple[object, ...]]:
        with psycopg.connect(db) as owner:
            return owner.execute("SELECT state, attempts, lease_token, lease_expires_at "
                                 "FROM idempotency.keys WHERE scope = 'theirs'").fetchall()

    before = foreign()
    try:
        dsn = psycopg.conninfo.make_conninfo(db, user=role)
        with psycopg.connect(dsn, autocommit=True) as conn:
            with pytest.raises(ScopeNotGranted) as caught:
                idem.takeover(conn, "theirs", "k")
            assert caught.value.sqlstate == "IK023" and caught.value.pgerror is not None
            assert isinstance(caught.value, idem.ScopeNotGranted)
            with pytest.raises(ScopeNotGranted):
                idem.list_abandoned(conn, scope="theirs")
            assert [(k.scope, k.key) for k in idem.list_abandoned(conn)] == [("mine", "k")]
            assert idem.takeover(conn, "mine", "k").outcome is idem.Outcome.RESUMED

        async def run() -> None:
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn:
                with pytest.raises(ScopeNotGranted):
                    await aio.takeover(aconn, "theirs", "k")
                with pytest.raises(ScopeNotGranted):
                    await aio.list_abandoned(aconn, scope="theirs")

        asyncio.run(run())
        assert len(before) == 1 and foreign() == before  # nothing of the foreign key moved
    finally:
        with psycopg.connect(db, autocommit=True) as owner:
            owner.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        with psycopg.connect(server.dsn("postgres"), autocommit=True) as admin:
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
