"""SQL_ASCII: a client encoding any session can set, and a database encoding legacy systems have.

Under a SQL_ASCII client encoding the server converts nothing, psycopg sends text as UTF-8 and
loads text as bytes (it cannot know their encoding). Before the package read its text as UTF-8
there (_wire.codec, _wire.dict_rows), an operation with a key that is not ASCII committed its
complete and then raised in the caller's hands: the outcome of the cleanup read b'completed',
and the completion time b'1796...' (TypeError). Checked here, on a UTF8 database with the
session's client encoding set to SQL_ASCII, and on a SQL_ASCII database:

- operation() claims, completes, replays and refuses a different request, for keys that are
  not ASCII and need quoting, through the package's own sends and through psycopg's cursors
  (heartbeat, checkpoint, release, the calls in a pipeline); every value read back is a str,
  and the row holds the key's UTF-8 bytes, as under UTF8;
- the CLI (status, migrate) on a SQL_ASCII database, and a SQLAlchemy session there as the
  request role (SQLAlchemy's psycopg dialect itself does not connect under a SQL_ASCII client
  encoding: its sessions set UTF8);
- on a SQL_ASCII database the engine sees bytes, not characters (docs/sql-api.md, "Text and
  encodings"): a byte 0x80-0x9f in a name counts as a control character (IK013, as for "€"),
  a key whose bytes are not UTF-8 is refused with 22021 before anything is written (claim
  hashes it as UTF-8), and the server's fingerprint of a request holding UTF-8 text is the
  package's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy
from helpers import MIGRATION_PSQL_ARGS, MIGRATIONS, admin_execute, login_roles
from helpers.api import run
from helpers.servers import ServerPool
from psycopg import sql
from sqlalchemy.orm import Session

import pg_idempotency as idem
from pg_idempotency import _calls, aio
from pg_idempotency.sqlalchemy import operation as sa_operation
from pgharness import PgServer

KEYS = ["plain", "clé 'é'\\", "漢字-€", "o'brien"]
# On a SQL_ASCII database: keys whose UTF-8 has no byte in 0x80-0x9f (see the test)
DB_KEYS = ["plain", "clé 'é'\\", "o'brien", "ñ-ü"]
ANSWER = {"id": "pay_é", "note": "it's \\ 漢"}


def _operations(conn: psycopg.Connection[Any], scope: str, keys: list[str]) -> None:
    """Every key through claim, complete, replay and a mismatch; the lease calls on another."""
    for key in keys:
        request = {"amount": 5, "note": key}
        with idem.operation(conn, scope, key, request) as op:
            assert op.outcome is idem.Outcome.CLAIMED
            stored = op.complete(201, ANSWER, headers={"X-Note": "é"})
        assert type(stored.completed_at).__name__ == "datetime"
        with idem.operation(conn, scope, key, request) as op:
            assert op.replay is not None
            assert op.replay.json() == ANSWER and op.replay.headers == {"X-Note": "é"}
            assert op.replay.completed_at == stored.completed_at
        with pytest.raises(idem.KeyMismatch):
            with idem.operation(conn, scope, key, {"other": key}):
                pass
    # the calls that go through psycopg's cursors (dict rows), with text in and out
    with idem.operation(conn, scope, "lease-é", {"a": 1}) as op:
        assert op.checkpoint("charged-é") is not None
        op.release()
    result = idem.claim(conn, scope, "lease-é", {"b": 2})
    assert result.outcome is idem.Outcome.CLAIMED
    assert result.recovery_point is None
    assert type(idem.heartbeat(conn, scope, "lease-é", result.lease_token)).__name__ == "datetime"
    with conn.transaction():
        idem.checkpoint(conn, scope, "lease-é", result.lease_token, "step-漢")
    again = idem.claim(conn, scope, "lease-é", {"b": 2})
    assert again.outcome is idem.Outcome.IN_PROGRESS and again.recovery_point == "step-漢"
    with conn.pipeline(), conn.transaction():
        completed_at = idem.complete(conn, scope, "lease-é", result.lease_token, 200, {"ok": "é"})
    assert type(completed_at).__name__ == "datetime"
    assert idem.claim(conn, scope, "lease-é", {"b": 2}).response.json() == {"ok": "é"}


def _stored(dsn: str, scope: str) -> list[tuple[bytes, int | None]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(
            "SELECT convert_to(key, 'UTF8'), response_status FROM idempotency.keys"
            " WHERE scope = %s ORDER BY 1", (scope,)).fetchall()


def test_operation_under_a_sql_ascii_client_encoding(server: PgServer, db: str) -> None:
    """As the application's login role (kind request, docs/install.md)."""
    with login_roles(server, db, "request") as (role,):
        with psycopg.connect(db, autocommit=True, client_encoding="SQL_ASCII",
                             user=role) as conn:
            assert conn.info.encoding == "ascii"
            # what psycopg does there: text parameters go as UTF-8, text comes back as bytes
            assert conn.execute("SELECT %s::text", ("é",)).fetchone() == ("é".encode(),)
            _operations(conn, "sc'é", KEYS)
        with psycopg.connect(db, autocommit=True, client_encoding="UTF8", user=role) as conn:
            _operations(conn, "utf8", KEYS)
    # the same rows, byte for byte, as a UTF8 session writes
    assert [k for k, _ in _stored(db, "sc'é")] == [k for k, _ in _stored(db, "utf8")]
    assert sorted(k for k, _ in _stored(db, "utf8")) == sorted(
        [k.encode() for k in KEYS] + ["lease-é".encode()])


@pytest.mark.anyio
async def test_aio_operation_under_a_sql_ascii_client_encoding(db: str) -> None:
    async with await psycopg.AsyncConnection.connect(
            db, autocommit=True, client_encoding="SQL_ASCII") as conn:
        for key in KEYS:
            async with aio.operation(conn, "aio", key, {"k": key}) as op:
                assert op.outcome is idem.Outcome.CLAIMED
                assert await op.checkpoint("step-é") is not None
                stored = await op.complete(201, ANSWER)
            async with aio.operation(conn, "aio", key, {"k": key}) as op:
                assert op.replay is not None and op.replay.json() == ANSWER
                assert op.replay.completed_at == stored.completed_at
        result = await aio.claim(conn, "aio", "lease-é", {"b": 2})
        assert result.outcome is idem.Outcome.CLAIMED
        await aio.release(conn, "aio", "lease-é", result.lease_token)
        again = await aio.claim(conn, "aio", "lease-é", {"b": 2})
        assert again.outcome is idem.Outcome.CLAIMED and again.lease_token > result.lease_token
    assert sorted(k for k, _ in _stored(db, "aio")) == sorted(
        [k.encode() for k in KEYS] + ["lease-é".encode()])


@pytest.fixture
def sql_ascii_db(server: PgServer, server_pool: ServerPool) -> Iterator[str]:
    name = server_pool.new_db_name("ascii")
    admin_execute(server, sql.SQL(
        "CREATE DATABASE {} TEMPLATE template0 ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C'"
    ).format(sql.Identifier(name)))
    try:
        dsn = server.dsn(name)
        for migration in sorted(Path(MIGRATIONS).glob("*.sql")):
            server.run_psql(dsn, migration, args=MIGRATION_PSQL_ARGS)
        yield dsn
    finally:
        admin_execute(server, sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
            sql.Identifier(name)))


def test_a_sql_ascii_database(sql_ascii_db: str) -> None:
    with psycopg.connect(sql_ascii_db, autocommit=True) as conn:
        assert conn.execute("SHOW server_encoding").fetchone() == (b"SQL_ASCII",)
        assert conn.info.encoding == "ascii"  # the default client encoding there
        _operations(conn, "sc'é", DB_KEYS)
        # The engine sees bytes there, not characters: a byte 0x80-0x9f counts as a control
        # character (IK013), as in "€" (e2 82 ac) and most CJK characters.
        with pytest.raises(idem.InvalidArgument) as refused:
            with idem.operation(conn, "s", "漢字-€", {"a": 1}):
                pass
        assert refused.value.sqlstate == "IK013"
        # the server's fingerprint of UTF-8 text is the package's
        request = {"amount": 5, "note": "café 漢"}
        server_fp = conn.execute("SELECT idempotency.fingerprint(%s::jsonb)",
                                 (_calls.jsonb(request),)).fetchone()[0]
        assert bytes(server_fp) == idem.fingerprint(request)
        # a key whose bytes are not UTF-8: refused before anything is written
        counts = ("SELECT (SELECT count(*) FROM idempotency.keys),"
                  " (SELECT count(*) FROM idempotency.key_directory)")
        before = conn.execute(counts).fetchone()
        with pytest.raises(psycopg.errors.CharacterNotInRepertoire) as info:
            conn.execute(b"SELECT outcome FROM idempotency.claim("
                         b"'s', 'k\xff', NULL, fingerprint => sha256('a'))")
        assert info.value.sqlstate == "22021"
        assert conn.execute(counts).fetchone() == before
    assert sorted(k for k, _ in _stored(sql_ascii_db, "sc'é")) == sorted(
        [k.encode() for k in DB_KEYS] + ["lease-é".encode()])
    assert _stored(sql_ascii_db, "s") == []


def test_the_cli_on_a_sql_ascii_database(sql_ascii_db: str) -> None:
    with psycopg.connect(sql_ascii_db, autocommit=True) as conn:
        claimed = idem.claim(conn, "cli-é", "k-ñ", {"a": 1})
        idem.complete(conn, "cli-é", "k-ñ", claimed.lease_token, 201)
        idem.claim(conn, "cli-é", "open-ñ", {"a": 1})
    proc = run("status", "--dsn", sql_ascii_db, "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    [scope] = doc["scopes"]
    assert (scope["scope"], scope["keys"], scope["in_progress"], scope["completed"]) == (
        "cli-é", 2, 1, 1)
    assert scope["oldest_in_progress_key"] == "open-ñ"
    proc = run("migrate", "--dsn", sql_ascii_db)
    assert proc.returncode == 0, proc.stderr


def test_sqlalchemy_session_as_the_request_role_on_a_sql_ascii_database(
        server: PgServer, sql_ascii_db: str) -> None:
    """The ORM a user brings, on a login role granted as docs/install.md says, on a SQL_ASCII
    database. SQLAlchemy's psycopg dialect does not connect under a SQL_ASCII client encoding
    (it reads the server's version text as bytes), so its sessions set UTF8, as docs/python.md
    says: a key that is not ASCII claimed, checkpointed, completed with the business row,
    replayed."""
    db = sql_ascii_db
    with login_roles(server, db, "request") as (role,), \
            psycopg.connect(db, autocommit=True) as admin:
        admin.execute("CREATE TABLE sa_ascii (id serial PRIMARY KEY, note text NOT NULL)")
        admin.execute(sql.SQL("GRANT SELECT, INSERT ON sa_ascii TO {}").format(
            sql.Identifier(role)))
        admin.execute(sql.SQL("GRANT USAGE ON SEQUENCE sa_ascii_id_seq TO {}").format(
            sql.Identifier(role)))
        engine = sqlalchemy.create_engine(
            "postgresql+psycopg://" + db.split("://", 1)[1],
            connect_args={"user": role, "options": "-c client_encoding=UTF8"})
        try:
            with Session(engine) as session:
                with sa_operation(session, "sa-é", "k-ñ-ü", {"amount": 7, "note": "漢"}) as op:
                    assert op.outcome is idem.Outcome.CLAIMED
                    session.execute(sqlalchemy.text("INSERT INTO sa_ascii (note) VALUES (:n)"),
                                    {"n": "paid é"})
                    assert op.checkpoint("charged-é") is not None
                    first = op.complete(201, ANSWER)
                with sa_operation(session, "sa-é", "k-ñ-ü", {"amount": 7, "note": "漢"}) as op:
                    assert op.replay is not None and op.replay.json() == ANSWER
                    assert op.replay.completed_at == first.completed_at
        finally:
            engine.dispose()
        assert admin.execute("SELECT note FROM sa_ascii").fetchall() == [("paid é".encode(),)]
    assert _stored(db, "sa-é") == [("k-ñ-ü".encode(), 201)]
