"""pg_idempotency.sqlalchemy on real PostgreSQL: operations on a Session / AsyncSession of the
application's own engine (postgresql+psycopg), a session bound to an aio.operation, and the
refusal of commits on other sessions while an operation is open."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy.exc
from helpers import login_roles
from sqlalchemy import String, create_engine, func, select, text
from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from pg_idempotency import aio
from pg_idempotency.errors import KeyInProgress, KeyMismatch
from pg_idempotency.sqlalchemy import (
    ForeignCommitError,
    aoperation,
    bind_session,
    operation,
)
from pgharness import WAIT_BOUND


class Base(DeclarativeBase):
    pass


class Entry(Base):
    __tablename__ = "sa_entries"

    id: Mapped[int] = mapped_column(primary_key=True)
    note: Mapped[str] = mapped_column(String(40))


def url(dsn: str) -> str:
    return "postgresql+psycopg://" + dsn.split("://", 1)[1]


@pytest.fixture
def engine(db: str) -> Iterator[Engine]:
    eng = create_engine(url(db), pool_size=10)
    Base.metadata.create_all(eng)
    yield eng
    eng.dispose()


def notes(db: str) -> list[str]:
    with psycopg.connect(db) as conn:
        return [r[0] for r in conn.execute("SELECT note FROM sa_entries ORDER BY id")]


def key_state(db: str, key: str) -> tuple[Any, ...] | None:
    with psycopg.connect(db) as conn:
        return conn.execute("SELECT completed_at IS NOT NULL, response_status "
                            "FROM idempotency.keys WHERE key = %s", (key,)).fetchone()


#: key_state() of a key that release() left for the next claim (in state released).
RELEASED = (False, None)


def released_token(db: str, key: str) -> int:
    """The token of a released key (its row kept, no lease, no response); fails otherwise."""
    with psycopg.connect(db) as conn:
        row = conn.execute("SELECT state, lease_expires_at, response_status, lease_token "
                           "FROM idempotency.keys WHERE key = %s", (key,)).fetchone()
    assert row is not None and row[:3] == ("released", None, None), row
    return row[3]


def test_session_operation_commits_writes_with_the_response(engine: Engine, db: str) -> None:
    with Session(engine) as session:
        with operation(session, "acct", "k1", {"amount": 5}) as op:
            assert op.replay is None and op.outcome.value == "claimed"
            entry = Entry(note="first")
            session.add(entry)
            stored = op.complete(201, {"id": 1})
        assert stored.status == 201 and not session.in_transaction()
        with operation(session, "acct", "k1", {"amount": 5}) as op:
            assert op.replay is not None and op.replay.json() == {"id": 1}
        with pytest.raises(KeyMismatch):
            with operation(session, "acct", "k1", {"amount": 6}):
                pass
    assert notes(db) == ["first"] and key_state(db, "k1") == (True, 201)


def test_session_operation_error_rolls_back_and_releases(engine: Engine, db: str) -> None:
    with Session(engine) as session:
        with pytest.raises(RuntimeError), operation(session, "acct", "k2", {"n": 1}):
            session.add(Entry(note="lost"))
            session.flush()  # in the database, inside the business transaction
            raise RuntimeError("boom")
        released = released_token(db, "k2")  # released: a retry runs afresh
        with operation(session, "acct", "k2", {"n": 1}) as op:
            assert op.outcome.value == "claimed" and op.attempts == 1
            assert op.lease_token > released
            session.add(Entry(note="kept"))
            op.complete(201)
    assert notes(db) == ["kept"] and key_state(db, "k2") == (True, 201)


def test_commit_on_another_session_is_refused(engine: Engine, db: str) -> None:
    with Session(engine) as session, Session(engine) as other:
        with pytest.raises(ForeignCommitError), operation(session, "acct", "k3", {}):
            session.add(Entry(note="mine"))
            other.add(Entry(note="foreign"))
            other.commit()
        other.rollback()  # as after any failed commit (SQLAlchemy insists)
        assert key_state(db, "k3") == RELEASED and released_token(db, "k3") > 0
        # and the foreign session's connection went back clean: nothing leaks into later work
        other.add(Entry(note="after"))
        other.commit()
    assert notes(db) == ["after"]


def test_committing_the_operations_own_session_is_refused(engine: Engine, db: str) -> None:
    """Only op.complete() commits: a session.commit() in the block would commit the writes
    before the response is stored."""
    with Session(engine) as session:
        with pytest.raises(ForeignCommitError), operation(session, "acct", "k4", {}):
            session.add(Entry(note="early"))
            session.commit()
        assert key_state(db, "k4") == RELEASED and released_token(db, "k4") > 0
    assert notes(db) == []


def test_8_concurrent_session_operations_one_row(engine: Engine, db: str) -> None:
    make = sessionmaker(engine)
    barrier = threading.Barrier(8)
    outcomes: list[str] = []

    def attempt() -> None:
        with make() as session:
            barrier.wait()
            try:
                with operation(session, "acct", "same", {"amount": 9}) as op:
                    if op.replay is not None:
                        outcomes.append("replay")
                        return
                    session.add(Entry(note="charged"))
                    session.flush()
                    session.execute(select(func.pg_sleep(0.2)))
                    op.complete(201, {"ok": True})
                    outcomes.append("executed")
            except KeyInProgress:
                outcomes.append("in_progress")

    threads = [threading.Thread(target=attempt) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_BOUND)
    assert not any(t.is_alive() for t in threads)
    assert len(outcomes) == 8 and outcomes.count("executed") == 1, outcomes
    assert notes(db) == ["charged"]


@pytest.mark.anyio
async def test_async_session_operation_and_refusal(db: str) -> None:
    eng = create_async_engine(url(db))
    async with eng.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    sessions = async_sessionmaker(eng, expire_on_commit=False)
    try:
        async with sessions() as session:
            async with aoperation(session, "acct", "a1", {"x": 1}) as op:
                session.add(Entry(note="async"))
                await op.complete(201, {"x": 1})
            async with aoperation(session, "acct", "a1", {"x": 1}) as op:
                assert op.replay is not None and op.replay.status == 201
            async with sessions() as other:
                with pytest.raises(ForeignCommitError):
                    async with aoperation(session, "acct", "a2", {"x": 2}):
                        other.add(Entry(note="foreign"))
                        await other.commit()
    finally:
        await eng.dispose()
    assert notes(db) == ["async"] and key_state(db, "a2") == RELEASED
    assert released_token(db, "a2") > 0


@pytest.mark.anyio
async def test_bind_session_to_an_aio_operation(db: str) -> None:
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute("CREATE TABLE sa_entries (id serial PRIMARY KEY, note varchar(40))")
    async with await psycopg.AsyncConnection.connect(db) as conn:
        async with aio.operation(conn, "acct", "b1", {"y": 1}) as op:
            async with bind_session(op) as session:
                assert isinstance(session, AsyncSession)
                session.add(Entry(note="bound"))
                await session.commit()  # a savepoint: not committed yet
                session.add(Entry(note="rolled back"))
                await session.flush()
                await session.rollback()  # back to the savepoint
                session.add(Entry(note="uncommitted"))
                await session.flush()  # never committed: dropped when the block closes
            assert notes(db) == []
            await op.complete(201)
        # the connection is the caller's, untouched: still usable, nothing left open
        assert (await (await conn.execute("SELECT 1")).fetchone()) == (1,)
        await conn.rollback()
    assert notes(db) == ["bound"] and key_state(db, "b1") == (True, 201)


HOSTILE_OPTIONS = "-c TimeZone=Pacific/Chatham -c search_path=public,pg_temp"
# psycopg parses timestamptz only in DateStyle ISO (and intervals only in IntervalStyle
# postgres): the package reads lease_expires_at, completed_at and retry_after as epoch
# seconds (queries._seconds), so a session operation works under these too.
DATESTYLE_OPTIONS = "-c DateStyle=SQL,DMY -c IntervalStyle=sql_standard"


@pytest.mark.parametrize("options", [
    HOSTILE_OPTIONS, f"{HOSTILE_OPTIONS} {DATESTYLE_OPTIONS}",
], ids=["timezone-search_path", "datestyle-intervalstyle"])
def test_session_operation_as_the_request_role_under_hostile_settings(
        engine: Engine, server: Any, db: str, options: str) -> None:
    """What a user deploys: the ORM on a login role granted as docs/install.md says (kind
    request), with session settings nobody chose for us. One row, then a byte-identical
    replay, a 422 for another body, and no way to take the key over."""
    with login_roles(server, db, "request") as (role,), psycopg.connect(db, autocommit=True) as c:
        c.execute(f'GRANT SELECT, INSERT ON sa_entries TO "{role}"')
        c.execute(f'GRANT USAGE ON SEQUENCE sa_entries_id_seq TO "{role}"')
        app = create_engine(url(db), connect_args={"user": role, "options": options})
        try:
            with Session(app) as session:
                with operation(session, "acct-r", "k-role", {"amount": 7}) as op:
                    assert op.outcome.value == "claimed"
                    session.add(Entry(note="as role"))
                    first = op.complete(201, {"id": 7})
                with operation(session, "acct-r", "k-role", {"amount": 7}) as op:
                    assert op.replay is not None
                    assert op.replay.content == first.content
                with pytest.raises(KeyMismatch):
                    with operation(session, "acct-r", "k-role", {"amount": 8}):
                        pass
                with pytest.raises(sqlalchemy.exc.ProgrammingError) as denied:
                    session.execute(text("SELECT * FROM idempotency.takeover('acct-r', 'k-role')"))
                assert denied.value.orig.sqlstate == "42501"
        finally:
            app.dispose()
    assert notes(db) == ["as role"] and key_state(db, "k-role") == (True, 201)
