"""pg_idempotency.sqlalchemy on real PostgreSQL: operations on a Session / AsyncSession of the
application's own engine, on every driver of helpers.sa_engines (sync: psycopg, psycopg through
``text()``, pg8000; async: psycopg, psycopg through ``text()``, asyncpg), a session bound to an
aio.operation, and the refusal of commits on other sessions while an operation is open."""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
import sqlalchemy.exc
from helpers import login_roles
from helpers import sa_engines as engines
from sqlalchemy import String, func, select, text
from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

import pg_idempotency as idem
from pg_idempotency import aio
from pg_idempotency.errors import (
    ArgumentEmpty,
    KeyInProgress,
    KeyMismatch,
    LeaseLost,
    LeaseLostCompleted,
)
from pg_idempotency.sqlalchemy import (
    ForeignCommitError,
    aoperation,
    bind_session,
    operation,
)
from pgharness import WAIT_BOUND, wait_until


class Base(DeclarativeBase):
    pass


class Entry(Base):
    __tablename__ = "sa_entries"

    id: Mapped[int] = mapped_column(primary_key=True)
    note: Mapped[str] = mapped_column(String(40))


@pytest.fixture(params=engines.SYNC)
def engine(request: pytest.FixtureRequest, db: str) -> Iterator[Engine]:
    eng = engines.engine(db, request.param, pool_size=10)
    Base.metadata.create_all(eng)
    try:
        with engines.statements_path(request.param):
            yield eng
    finally:
        eng.dispose()


@asynccontextmanager
async def async_sessions(db: str, flavour: str, **kwargs: Any
                         ) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    eng = engines.async_engine(db, flavour, **kwargs)
    async with eng.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    try:
        with engines.statements_path(flavour):
            yield async_sessionmaker(eng, expire_on_commit=False)
    finally:
        await eng.dispose()


def notes(db: str) -> list[str]:
    with psycopg.connect(db) as conn:
        return [r[0] for r in conn.execute("SELECT note FROM sa_entries ORDER BY id")]


def key_state(db: str, key: str) -> tuple[Any, ...] | None:
    with psycopg.connect(db) as conn:
        return conn.execute("SELECT completed_at IS NOT NULL, response_status "
                            "FROM idempotency.keys WHERE key = %s", (key,)).fetchone()


def key_rows(db: str, key: str) -> int:
    with psycopg.connect(db) as conn:
        return conn.execute("SELECT count(*) FROM idempotency.keys "  # type: ignore[index]
                            "WHERE key = %s", (key,)).fetchone()[0]


def lease_ran_out(db: str, key: str) -> bool:
    with psycopg.connect(db) as conn:
        row = conn.execute("SELECT lease_expires_at < clock_timestamp() FROM idempotency.keys"
                           " WHERE key = %s", (key,)).fetchone()
    return bool(row and row[0])


#: key_state() of a key that release() left for the next claim (in state released).
RELEASED = (False, None)


def released_token(db: str, key: str) -> int:
    """The token of a released key (its row kept, no lease, no response); fails otherwise."""
    with psycopg.connect(db) as conn:
        row = conn.execute("SELECT state, lease_expires_at, response_status, lease_token "
                           "FROM idempotency.keys WHERE key = %s", (key,)).fetchone()
    assert row is not None and row[:3] == ("released", None, None), row
    return row[3]


def from_driver(error: BaseException | None, flavour: str) -> bool:
    """Whether ``error`` (an exception's pgerror) is the flavour's driver's own."""
    return error is not None and \
        type(error).__module__.split(".")[0] == engines.driver(flavour)


def test_session_operation_commits_writes_with_the_response(engine: Engine, db: str) -> None:
    with Session(engine) as session:
        with operation(session, "acct", "k1", {"amount": 5}) as op:
            assert op.replay is None and op.outcome is idem.Outcome.CLAIMED
            assert isinstance(op.lease_token, int) and op.attempts == 1
            assert isinstance(op.claim_result.lease_expires_at, datetime)
            entry = Entry(note="first")
            session.add(entry)
            stored = op.complete(201, {"id": 1, "zeta": 2, "a": [1.5]})
        assert stored.status == 201 and not session.in_transaction()
        assert stored.completed_at is not None and stored.completed_at.tzinfo is not None
        with operation(session, "acct", "k1", {"amount": 5}) as op:
            assert op.outcome is idem.Outcome.REPLAY and op.replay is not None
            assert op.replay.content == stored.content == b'{"id":1,"zeta":2,"a":[1.5]}'
            assert op.replay.completed_at == stored.completed_at
            assert op.replay.json() == {"id": 1, "zeta": 2, "a": [1.5]}
        with pytest.raises(KeyMismatch) as mismatch:
            with operation(session, "acct", "k1", {"amount": 6}):
                pass
        assert mismatch.value.sqlstate == "IK002"
    assert notes(db) == ["first"] and key_state(db, "k1") == (True, 201)


def test_session_operation_error_rolls_back_and_releases(engine: Engine, db: str) -> None:
    with Session(engine) as session:
        with pytest.raises(RuntimeError), operation(session, "acct", "k2", {"n": 1}):
            session.add(Entry(note="lost"))
            session.flush()  # in the database, inside the business transaction
            raise RuntimeError("boom")
        released = released_token(db, "k2")  # released: a retry runs afresh
        with operation(session, "acct", "k2", {"n": 1}) as op:
            assert op.outcome is idem.Outcome.CLAIMED and op.attempts == 1
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


def test_engine_errors_by_sqlstate(engine: Engine, db: str) -> None:
    """The engine's errors, raised through SQLAlchemy, as the package's classes with the
    server's SQLSTATE, DETAIL, HINT and COLUMN, whatever the driver: IK011 for an empty
    scope, KeyInProgress while another session holds the key, LeaseLost (IK001) at complete()
    for an attempt whose lease ran out and was resumed by another, which alone writes."""
    flavour = engine.url.drivername.split("+")[1]
    with Session(engine) as session:
        with pytest.raises(ArgumentEmpty) as empty:
            with operation(session, "", "k-empty", {"n": 1}):
                pass
        assert empty.value.sqlstate == "IK011" and empty.value.argument == "scope"
        assert from_driver(empty.value.pgerror, flavour) and not session.in_transaction()

        slow = operation(session, "acct", "k-lease", {"n": 2}, lease=0.5)
        with pytest.raises(LeaseLost) as lost, slow:
            session.add(Entry(note="late"))
            session.flush()

            def meanwhile() -> None:  # another client: outside this operation's guard
                with Session(engine) as other:
                    with pytest.raises(KeyInProgress) as busy:
                        with operation(other, "acct", "k-lease", {"n": 2}):
                            pass
                    assert isinstance(busy.value.retry_after, timedelta)
                    wait_until(lambda: lease_ran_out(db, "k-lease"), "the lease to run out")
                    with operation(other, "acct", "k-lease", {"n": 2}) as op:
                        assert op.outcome is idem.Outcome.RESUMED and op.attempts == 2
                        other.add(Entry(note="resumed"))
                        op.complete(201, {"by": "resumer"})

            contextvars.Context().run(meanwhile)
            slow.complete(201, {"by": "late"})
        assert lost.value.sqlstate == "IK001" and lost.value.detail and lost.value.hint
        assert not isinstance(lost.value, LeaseLostCompleted)
        assert from_driver(lost.value.pgerror, flavour)
        with operation(session, "acct", "k-lease", {"n": 2}) as op:
            assert op.replay is not None and op.replay.json() == {"by": "resumer"}
    assert notes(db) == ["resumed"] and key_state(db, "k-empty") is None
    assert key_state(db, "k-lease") == (True, 201)


def test_checkpoint_then_failure_keeps_the_key_for_a_resume(engine: Engine, db: str) -> None:
    with Session(engine) as session:
        with pytest.raises(RuntimeError), \
                operation(session, "acct", "k-cp", {"n": 3}, lease=0.5) as op:
            session.add(Entry(note="step 1"))
            expires = op.checkpoint("charged")  # commits step 1 with its recovery point
            assert isinstance(expires, datetime) and expires.tzinfo is not None
            session.add(Entry(note="step 2"))
            raise RuntimeError("after the checkpoint")
        assert key_state(db, "k-cp") == (False, None)  # kept in progress, not released
        wait_until(lambda: lease_ran_out(db, "k-cp"), "the lease to run out")
        with operation(session, "acct", "k-cp", {"n": 3}) as op:
            assert op.outcome is idem.Outcome.RESUMED and op.recovery_point == "charged"
            session.add(Entry(note="step 2"))
            op.complete(201)
    assert notes(db) == ["step 1", "step 2"] and key_state(db, "k-cp") == (True, 201)


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


# -- AsyncSession -------------------------------------------------------------------------------

@pytest.mark.anyio
@pytest.mark.parametrize("flavour", engines.ASYNC)
async def test_async_session_operation_and_refusal(db: str, flavour: str) -> None:
    async with async_sessions(db, flavour) as sessions:
        async with sessions() as session:
            async with aoperation(session, "acct", "a1", {"x": 1}) as op:
                assert op.outcome is idem.Outcome.CLAIMED
                session.add(Entry(note="async"))
                first = await op.complete(201, {"x": 1, "b": None})
            async with aoperation(session, "acct", "a1", {"x": 1}) as op:
                assert op.replay is not None and op.replay.status == 201
                assert op.replay.content == first.content == b'{"x":1,"b":null}'
                assert op.replay.completed_at == first.completed_at
            with pytest.raises(KeyMismatch):
                async with aoperation(session, "acct", "a1", {"x": 2}):
                    pass
            async with sessions() as other:
                with pytest.raises(ForeignCommitError):
                    async with aoperation(session, "acct", "a2", {"x": 2}):
                        other.add(Entry(note="foreign"))
                        await other.commit()
            with pytest.raises(RuntimeError):
                async with aoperation(session, "acct", "a3", {"x": 3}):
                    session.add(Entry(note="rolled back"))
                    await session.flush()
                    raise RuntimeError("boom")
    assert notes(db) == ["async"] and key_state(db, "a2") == RELEASED
    assert released_token(db, "a2") > 0 and released_token(db, "a3") > 0


@pytest.mark.anyio
@pytest.mark.parametrize("flavour", engines.ASYNC)
async def test_async_engine_errors_by_sqlstate(db: str, flavour: str) -> None:
    """test_engine_errors_by_sqlstate on an AsyncSession."""
    async with async_sessions(db, flavour) as sessions, sessions() as session:
        with pytest.raises(ArgumentEmpty) as empty:
            async with aoperation(session, "", "k-empty", {"n": 1}):
                pass
        assert empty.value.sqlstate == "IK011" and empty.value.argument == "scope"
        assert from_driver(empty.value.pgerror, flavour)

        async def meanwhile() -> None:
            async with sessions() as other:
                with pytest.raises(KeyInProgress) as busy:
                    async with aoperation(other, "acct", "k-lease", {"n": 2}):
                        pass
                assert isinstance(busy.value.retry_after, timedelta)
                await asyncio.to_thread(wait_until, lambda: lease_ran_out(db, "k-lease"),
                                        "the lease to run out")
                async with aoperation(other, "acct", "k-lease", {"n": 2}) as op:
                    assert op.outcome is idem.Outcome.RESUMED
                    other.add(Entry(note="resumed"))
                    await op.complete(201, {"by": "resumer"})

        with pytest.raises(LeaseLost) as lost:
            async with aoperation(session, "acct", "k-lease", {"n": 2}, lease=0.5) as op:
                session.add(Entry(note="late"))
                await session.flush()
                # another client, outside this operation's guard
                await asyncio.create_task(meanwhile(), context=contextvars.Context())
                await op.complete(201, {"by": "late"})
        assert lost.value.sqlstate == "IK001" and lost.value.detail
        assert from_driver(lost.value.pgerror, flavour)
    assert notes(db) == ["resumed"] and key_state(db, "k-lease") == (True, 201)


@pytest.mark.anyio
@pytest.mark.parametrize("flavour", engines.ASYNC)
async def test_20_concurrent_aoperations_one_row(db: str, flavour: str) -> None:
    """20 sessions on 20 connections race for one key: one executes and writes the row, every
    other one replays its answer or is told the key is in progress."""
    outcomes: list[str] = []
    answers: set[bytes] = set()
    async with async_sessions(db, flavour, pool_size=20) as sessions:
        barrier = asyncio.Barrier(20)

        async def attempt() -> None:
            async with sessions() as session:
                await session.connection()  # each on its own connection before the race
                await session.rollback()
                await barrier.wait()
                try:
                    async with aoperation(session, "acct", "same", {"amount": 9}) as op:
                        if op.replay is not None:
                            outcomes.append("replay")
                            answers.add(op.replay.content)
                            return
                        session.add(Entry(note="charged"))
                        await session.flush()
                        await session.execute(select(func.pg_sleep(0.3)))
                        answers.add((await op.complete(201, {"ok": True})).content)
                        outcomes.append("executed")
                except KeyInProgress:
                    outcomes.append("in_progress")

        started = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*(attempt() for _ in range(20))), WAIT_BOUND)
        assert time.monotonic() - started < WAIT_BOUND
    assert len(outcomes) == 20 and outcomes.count("executed") == 1, outcomes
    assert outcomes.count("in_progress") >= 1, outcomes
    assert answers == {b'{"ok":true}'}
    assert notes(db) == ["charged"] and key_state(db, "same") == (True, 201)
    assert key_rows(db, "same") == 1


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


HOSTILE = {"TimeZone": "Pacific/Chatham", "search_path": "public,pg_temp"}
# psycopg parses timestamptz only in DateStyle ISO (and intervals only in IntervalStyle
# postgres): the package reads lease_expires_at, completed_at and retry_after as epoch
# seconds (queries._seconds), so a session operation works under these too, on any driver.
DATESTYLE = {"DateStyle": "SQL,DMY", "IntervalStyle": "sql_standard"}


def sqlstate_of(error: sqlalchemy.exc.DBAPIError) -> str | None:
    """The SQLSTATE of SQLAlchemy's error, from the driver's own (read here as each driver
    carries it, independently of the package)."""
    orig: Any = error.orig
    if hasattr(orig, "sqlstate") and isinstance(orig.sqlstate, str):
        return str(orig.sqlstate)
    if orig.args and isinstance(orig.args[0], dict):  # pg8000: the protocol's fields
        return str(orig.args[0]["C"])
    return None


@pytest.mark.parametrize("settings", [HOSTILE, {**HOSTILE, **DATESTYLE}],
                         ids=["timezone-search_path", "datestyle-intervalstyle"])
@pytest.mark.parametrize("flavour", engines.SYNC)
def test_session_operation_as_the_request_role_under_hostile_settings(
        server: Any, db: str, settings: dict[str, str], flavour: str) -> None:
    """What a user deploys: the ORM on a login role granted as docs/install.md says (kind
    request), with session settings nobody chose for us. One row, then a byte-identical
    replay, a 422 for another body, and no way to take the key over."""
    with login_roles(server, db, "request") as (role,), psycopg.connect(db, autocommit=True) as c:
        c.execute("CREATE TABLE sa_entries (id serial PRIMARY KEY, note varchar(40))")
        c.execute(f'GRANT SELECT, INSERT ON sa_entries TO "{role}"')
        c.execute(f'GRANT USAGE ON SEQUENCE sa_entries_id_seq TO "{role}"')
        app = engines.engine(db, flavour,
                             connect_args=engines.connect_args(flavour, user=role,
                                                               settings=settings))
        try:
            with engines.statements_path(flavour), Session(app) as session:
                assert session.execute(text("SHOW TimeZone")).scalar_one() == "Pacific/Chatham"
                session.rollback()
                with operation(session, "acct-r", "k-role", {"amount": 7}) as op:
                    assert op.outcome is idem.Outcome.CLAIMED
                    session.add(Entry(note="as role"))
                    first = op.complete(201, {"id": 7})
                with operation(session, "acct-r", "k-role", {"amount": 7}) as op:
                    assert op.replay is not None
                    assert op.replay.content == first.content
                    assert op.replay.completed_at == first.completed_at
                with pytest.raises(KeyMismatch):
                    with operation(session, "acct-r", "k-role", {"amount": 8}):
                        pass
                with pytest.raises(sqlalchemy.exc.ProgrammingError) as denied:
                    session.execute(text("SELECT * FROM idempotency.takeover('acct-r', 'k-role')"))
                assert sqlstate_of(denied.value) == "42501"
        finally:
            app.dispose()
    assert notes(db) == ["as role"] and key_state(db, "k-role") == (True, 201)


@pytest.mark.parametrize("flavour", ["psycopg", "psycopg-text"])
def test_psycopg_sessions_never_prepare_the_packages_statements(db: str, flavour: str) -> None:
    """Why psycopg sessions get the package's statements on the psycopg connection itself:
    with psycopg's default prepare_threshold (5), a statement run through SQLAlchemy is
    prepared under a name on its sixth use, which a transaction-mode pooler can hand to
    another client (docs/install.md, "Connection poolers"). Directly, never."""
    eng = engines.engine(db, flavour)
    Base.metadata.create_all(eng)
    try:
        with engines.statements_path(flavour), Session(eng) as session:
            for i in range(8):
                with operation(session, "acct", f"p{i}", {"i": i}) as op:
                    session.add(Entry(note=f"p{i}"))
                    op.complete(201, {"i": i})
            prepared = session.execute(
                text("SELECT statement FROM pg_prepared_statements")).scalars().all()
            session.rollback()
    finally:
        eng.dispose()
    ours = [s for s in prepared if "idempotency." in s]
    if flavour == "psycopg":
        assert ours == [], ours
    else:  # what the direct path prevents
        assert any("idempotency.claim(" in s for s in ours), prepared
    assert len(notes(db)) == 8
