"""heartbeat_outcome, checkpoint_outcome and release_outcome on one server (PostgreSQL 15 and
18): the answers of heartbeat, checkpoint and release as a value instead of an error (issue
33; on Citus an error costs a new worker connection, tests/citus/test_citus_outcomes.py).

- Every key state gives the outcome that matches the raising form's answer (None -> ok,
  IK001 -> lease_lost, IK004 -> completed), as the request role, and a lost lease writes
  nothing; the raising forms still raise.
- Bad arguments still raise, with the documented SQLSTATE naming the argument, and write
  nothing.
- The package (sync and async) raises the same LeaseLost / LeaseLostCompleted as before from
  heartbeat(), release(), op.checkpoint() and op.release(), with no ERROR in the server's log
  and the caller's transaction left usable; op.checkpoint() rolls the step's writes back.
- Results do not depend on the session's DateStyle / TimeZone / IntervalStyle.
- No timing oracle: a wrong token costs the same on the server whatever the key's state.
"""

from __future__ import annotations

import inspect
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import asyncpg
import psycopg
import pytest
from helpers import login_roles
from helpers.api import idle, rollback
from helpers.probes import (
    HOSTILE_SETTINGS,
    KEYS_PER_CLASS,
    STATES,
    WRONG_TOKEN,
    apply,
    judge,
    make_keys,
)
from psycopg import sql

import pg_idempotency as idem
from pg_idempotency import aio, errors

pytestmark = pytest.mark.anyio

#: (raising form, outcome form), as the request role calls them.
FORMS = {
    "heartbeat": ("SELECT idempotency.heartbeat(%(s)s, %(k)s, %(t)s)",
                  "SELECT * FROM idempotency.heartbeat_outcome(%(s)s, %(k)s, %(t)s)"),
    "checkpoint": ("SELECT idempotency.checkpoint(%(s)s, %(k)s, %(t)s, 'step-2')",
                   "SELECT * FROM idempotency.checkpoint_outcome(%(s)s, %(k)s, %(t)s, 'step-2')"),
    "release": ("SELECT idempotency.release(%(s)s, %(k)s, %(t)s)",
                "SELECT * FROM idempotency.release_outcome(%(s)s, %(k)s, %(t)s)"),
}
OUTCOME_OF = {None: "ok", "IK001": "lease_lost", "IK004": "completed"}


async def call(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _scope() -> str:
    return f"lo_{uuid.uuid4().hex[:10]}"


def server_log(server: Any) -> str:
    """The server's log: the output testing.postgresql writes to <class name>.log."""
    logs = sorted(Path(server.tmpdir).glob("*Postgresql.log"))
    assert len(logs) == 1, logs
    return logs[0].read_text(errors="replace")


def errors_about(server: Any, scope: str) -> list[str]:
    """The server log's ERROR lines that name ``scope`` (a fenced call's error names its key
    and scope; each test has a scope of its own)."""
    return [line for line in server_log(server).splitlines()
            if "ERROR:" in line and f'"{scope}"' in line]


def row(db: str, scope: str, key: str) -> tuple[Any, ...] | None:
    with psycopg.connect(db) as conn:
        return conn.execute(
            "SELECT state, lease_token, lease_expires_at, recovery_point FROM idempotency.keys"
            " WHERE scope = %s AND key = %s", (scope, key)).fetchone()


def make_state(conn: psycopg.Connection[Any], scope: str, key: str, state: str) -> int:
    """A key in ``state`` (in_progress, completed, released, taken_over, absent); returns the
    token its first owner held (a made-up one for absent)."""
    if state == "absent":
        return 1234567
    token = conn.execute("SELECT lease_token FROM idempotency.claim(%s, %s, '{}', lease => "
                         "'1 hour')", (scope, key)).fetchone()[0]
    conn.execute("SELECT idempotency.checkpoint(%s, %s, %s, 'step-1')", (scope, key, token))
    if state == "completed":
        conn.execute("SELECT idempotency.complete(%s, %s, %s, 200, '{}')", (scope, key, token))
    elif state == "released":
        conn.execute("SELECT idempotency.release(%s, %s, %s)", (scope, key, token))
    elif state == "taken_over":
        # The lease ran out and a retry resumed the key: the first token is stale.
        later = datetime.now(timezone.utc) + timedelta(hours=2)
        outcome = conn.execute("SELECT outcome FROM idempotency.claim(%s, %s, '{}', "
                               "reference_time => %s)", (scope, key, later)).fetchone()[0]
        assert outcome == "resumed"
    return token


CASES = [
    # (state, token offset from the first owner's): the raising form's answer decides
    ("in_progress", 0), ("in_progress", 1), ("completed", 0), ("completed", 1),
    ("released", 0), ("taken_over", 0), ("absent", 0),
]


@pytest.mark.parametrize("fn", sorted(FORMS))
@pytest.mark.parametrize(("state", "offset"), CASES)
def test_the_outcome_says_what_the_raising_form_raises(server: Any, db: str, fn: str,
                                                       state: str, offset: int) -> None:
    scope = _scope()
    raising, answering = FORMS[fn]
    with login_roles(server, db, "request") as (role,), \
            psycopg.connect(db, autocommit=True) as owner, \
            psycopg.connect(db, user=role, autocommit=True) as app:
        # Two keys in the same state: one for each form, so both see the state untouched.
        keys = {form: f"{state}-{form}" for form in ("raising", "answering")}
        tokens = {form: make_state(owner, scope, key, state) + offset
                  for form, key in keys.items()}
        before = row(db, scope, keys["answering"])
        args = {"s": scope, "k": keys["raising"], "t": tokens["raising"]}
        try:
            app.execute(raising, args)
            sqlstate = None
        except psycopg.Error as exc:
            sqlstate = exc.sqlstate
        expected = {("in_progress", 0): None, ("completed", 0): "IK004"}.get((state, offset),
                                                                             "IK001")
        assert sqlstate == expected
        outcome, *rest = app.execute(answering, {**args, "k": keys["answering"],
                                                 "t": tokens["answering"]}).fetchone()
        assert outcome == OUTCOME_OF[sqlstate]
        after = row(db, scope, keys["answering"])
        if outcome != "ok":
            assert after == before  # nothing written: lease, recovery point, state
            assert rest in ([], [None])
        elif fn == "release":
            assert after is not None and after[0] == "released" and rest == [None]
        else:
            assert after is not None and after[0] == "in_progress"
            assert rest == [after[2]] and after[2] >= before[2]
            assert after[3] == ("step-2" if fn == "checkpoint" else "step-1")


BAD_ARGUMENTS = [
    # (function, arguments, SQLSTATE, argument named)
    ("heartbeat_outcome", "NULL, 'k', {t}", "IK010", "scope"),
    ("heartbeat_outcome", "'s', NULL, {t}", "IK010", "key"),
    ("heartbeat_outcome", "'s', 'k', NULL", "IK010", "lease_token"),
    ("heartbeat_outcome", "'s', repeat('k', 256), {t}", "IK012", "key"),
    ("heartbeat_outcome", "'s', 'k', {t}, lease => '0 s'", "IK014", "lease"),
    ("heartbeat_outcome", "'s', 'k', {t}, lease => NULL", "IK010", "lease"),
    ("heartbeat_outcome", "'s', 'k', {t}, lease => '2 days'", "IK014", "lease"),
    ("checkpoint_outcome", "'s', 'k', {t}, NULL", "IK010", "recovery_point"),
    ("checkpoint_outcome", "'s', 'k', {t}, repeat('r', 256)", "IK012", "recovery_point"),
    ("checkpoint_outcome", "repeat('s', 256), 'k', {t}, 'r'", "IK012", "scope"),
    ("checkpoint_outcome", "'s', 'k', {t}, 'r', extend => '-1 s'", "IK014", "extend"),
    ("checkpoint_outcome", "'s', E'k\\n', {t}, 'r'", "IK013", "key"),
    ("release_outcome", "'', 'k', {t}", "IK011", "scope"),
    ("release_outcome", "'s', 'k', NULL", "IK010", "lease_token"),
    ("release_outcome", "'s', repeat('k', 10000), {t}", "IK012", "key"),
]


@pytest.mark.parametrize(("fn", "args", "sqlstate", "argument"), BAD_ARGUMENTS)
def test_bad_arguments_still_raise_naming_the_argument(server: Any, db: str, fn: str, args: str,
                                                       sqlstate: str, argument: str) -> None:
    with login_roles(server, db, "request") as (role,), \
            psycopg.connect(db, autocommit=True) as owner, \
            psycopg.connect(db, user=role, autocommit=True) as app:
        token = owner.execute("SELECT lease_token FROM idempotency.claim('s', 'k', '{}')"
                              ).fetchone()[0]
        before = row(db, "s", "k")
        with pytest.raises(psycopg.Error) as raised:
            app.execute(f"SELECT * FROM idempotency.{fn}({args.format(t=token)})")
        assert raised.value.sqlstate == sqlstate
        assert raised.value.diag.column_name == argument
        assert raised.value.diag.message_primary.startswith(
            f'idempotency.{fn}: argument "{argument}"')
        assert row(db, "s", "k") == before  # nothing written


@pytest.fixture(params=["sync", "async"])
async def flavour(request: pytest.FixtureRequest, db: str) -> Any:
    """(api module, connection, ledger) for the sync or the async API, not in autocommit (so
    a server error would leave the transaction INERROR)."""
    with psycopg.connect(db, autocommit=True) as setup:
        setup.execute("CREATE TABLE IF NOT EXISTS ledger (key text, amount integer)")
    if request.param == "sync":
        with psycopg.connect(db) as conn:
            yield idem, conn
    else:
        async with await psycopg.AsyncConnection.connect(db) as conn:
            yield aio, conn


@pytest.fixture(params=["sync", "async", "asyncpg"])
async def any_flavour(request: pytest.FixtureRequest, db: str) -> Any:
    """:func:`flavour`, and the async API on an asyncpg connection (which has no implicit
    transaction)."""
    with psycopg.connect(db, autocommit=True) as setup:
        setup.execute("CREATE TABLE IF NOT EXISTS ledger (key text, amount integer)")
    if request.param == "sync":
        with psycopg.connect(db) as conn:
            yield idem, conn
    elif request.param == "async":
        async with await psycopg.AsyncConnection.connect(db) as conn:
            yield aio, conn
    else:
        conn = await asyncpg.connect(db)
        try:
            yield aio, conn
        finally:
            await conn.close()


async def test_the_package_raises_lease_lost_with_no_server_error(flavour: Any, server: Any,
                                                                   db: str) -> None:
    api, conn = flavour
    scope = _scope()
    with psycopg.connect(db, autocommit=True) as owner:
        stale = make_state(owner, scope, "taken", "taken_over")
        done = make_state(owner, scope, "done", "completed")
        old_form: dict[str, str] = {}
        for what, query in (("heartbeat", "SELECT idempotency.heartbeat(%s, 'taken', %s)"),
                            ("release", "SELECT idempotency.release(%s, 'taken', %s)")):
            with pytest.raises(psycopg.Error) as raised:
                owner.execute(query, (scope, stale))
            old_form[what] = raised.value.diag.message_primary
    log_errors = len(errors_about(server, scope))
    assert log_errors == 2  # the server logs the raising forms' errors...

    for what, fn in (("heartbeat", api.heartbeat), ("release", api.release)):
        with pytest.raises(errors.LeaseLost) as lost:
            await call(fn(conn, scope, "taken", stale))
        assert type(lost.value) is errors.LeaseLost and lost.value.sqlstate == "IK001"
        # the same words as the raising form's IK001, DETAIL and HINT included
        assert str(lost.value) == old_form[what]
        assert lost.value.detail and lost.value.hint and lost.value.pgerror is None
        # no error on the server: the caller's transaction is open and usable
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        await call(conn.execute("SELECT 1"))
        await call(conn.rollback())
    for fn in (api.heartbeat, api.release):
        with pytest.raises(errors.LeaseLostCompleted) as own:
            await call(fn(conn, scope, "done", done))
        assert own.value.sqlstate == "IK004" and "is already completed" in str(own.value)
        await call(conn.rollback())
    # ...and none from the outcome forms
    assert len(errors_about(server, scope)) == log_errors
    # the right token still works and returns the lease
    token = await call(api.claim(conn, scope, "live", {}, lease=60))
    await call(conn.commit())
    before = datetime.now(timezone.utc)
    expires = await call(api.heartbeat(conn, scope, "live", token.lease_token, lease=600))
    after = datetime.now(timezone.utc)
    # now + 600 s, now being the server's clock during the call (one machine, one clock;
    # 1 ms for rounding)
    lease = timedelta(seconds=600)
    assert before + lease - timedelta(milliseconds=1) <= expires <= after + lease
    await call(api.release(conn, scope, "live", token.lease_token))
    await call(conn.commit())
    assert row(db, scope, "live")[0] == "released"


async def test_op_checkpoint_after_a_takeover_rolls_the_step_back(any_flavour: Any, server: Any,
                                                                  db: str) -> None:
    api, conn = any_flavour
    scope = _scope()
    op = api.operation(conn, scope, "op", {"a": 1}, lease=60)
    with pytest.raises(errors.LeaseLost) as lost:
        if api is aio:
            async with op:
                await conn.execute("INSERT INTO ledger VALUES ('op', 1)")
                _take_over(db, scope, "op")
                await op.checkpoint("step-1")
        else:
            with op:
                conn.execute("INSERT INTO ledger VALUES ('op', 1)")
                _take_over(db, scope, "op")
                op.checkpoint("step-1")
    assert type(lost.value) is errors.LeaseLost
    with psycopg.connect(db) as check:
        assert check.execute("SELECT count(*) FROM ledger WHERE key = 'op'").fetchone()[0] == 0
    state, _token, _expires, recovery_point = row(db, scope, "op")
    assert (state, recovery_point) == ("in_progress", None)  # the new owner's, untouched
    assert errors_about(server, scope) == []
    assert idle(conn)


def _take_over(db: str, scope: str, key: str) -> None:
    """Another attempt resumes ``key`` as if its lease had run out."""
    later = datetime.now(timezone.utc) + timedelta(hours=2)
    with psycopg.connect(db, autocommit=True) as other:
        assert other.execute("SELECT outcome FROM idempotency.claim(%s, %s, %s::jsonb, "
                             "reference_time => %s)", (scope, key, '{"a": 1}', later)
                             ).fetchone()[0] == "resumed"


async def test_op_release_and_the_block_end_after_a_takeover(any_flavour: Any, server: Any,
                                                             db: str) -> None:
    api, conn = any_flavour
    scope = _scope()
    # op.release() on a key taken over: LeaseLost, no server error
    with pytest.raises(errors.LeaseLost):
        if api is aio:
            async with api.operation(conn, scope, "rel", {"a": 1}) as op:
                _take_over(db, scope, "rel")
                await op.release()
        else:
            with api.operation(conn, scope, "rel", {"a": 1}) as op:
                _take_over(db, scope, "rel")
                op.release()
    # a block that fails after a takeover: its release at the end meets the lost lease
    # quietly, and the block's own error is the one raised
    with pytest.raises(ZeroDivisionError):
        if api is aio:
            async with api.operation(conn, scope, "exit", {"a": 1}):
                _take_over(db, scope, "exit")
                1 / 0  # noqa: B018
        else:
            with api.operation(conn, scope, "exit", {"a": 1}):
                _take_over(db, scope, "exit")
                1 / 0  # noqa: B018
    for key in ("rel", "exit"):
        assert row(db, scope, key)[0] == "in_progress"  # the new owner's
    assert errors_about(server, scope) == []


@pytest.mark.parametrize("settings", HOSTILE_SETTINGS, ids=["dublin", "chatham", "st_johns"])
def test_results_do_not_depend_on_session_settings(server: Any, db: str,
                                                   settings: dict[str, str]) -> None:
    scope = _scope()
    with login_roles(server, db, "request") as (role,), \
            psycopg.connect(db, user=role, autocommit=True) as conn:
        apply(conn, settings)
        claimed = idem.claim(conn, scope, "k", {}, lease=60)
        expires = idem.heartbeat(conn, scope, "k", claimed.lease_token, lease=3600)
        stored = row(db, scope, "k")[2]
        assert expires == stored
        with conn.transaction():
            expires = idem.checkpoint(conn, scope, "k", claimed.lease_token, "s", extend=7200)
        assert expires == row(db, scope, "k")[2]
        with pytest.raises(errors.LeaseLost):
            idem.heartbeat(conn, scope, "k", claimed.lease_token + 1)
        idem.release(conn, scope, "k", claimed.lease_token)
        assert row(db, scope, "k")[0] == "released"
    assert errors_about(server, scope) == []


OUTCOME_CALLS = {
    "heartbeat_outcome": "idempotency.heartbeat_outcome(v_scope, v_key, {t})",
    "checkpoint_outcome": "idempotency.checkpoint_outcome(v_scope, v_key, {t}, 'step')",
    "release_outcome": "idempotency.release_outcome(v_scope, v_key, {t})",
}


def server_side(conn: psycopg.Connection[Any], call_sql: str, classes: list[str]
                ) -> dict[str, list[float]]:
    """Microseconds per wrong-token call, by class ('scope/state'), timed inside the server
    (as tests/probes/test_timing_oracle.py, without the exception block: nothing raises)."""
    conn.execute("DROP TABLE IF EXISTS pg_temp.timing")
    conn.execute("CREATE TEMP TABLE timing (cls text, us float8, outcome text)")
    conn.execute(sql.SQL("""
DO $$
DECLARE t0 timestamptz; t1 timestamptz; v_scope text; v_key text; v_cls text; v_out text;
BEGIN
  FOR i IN 0 .. {last} LOOP
    FOR v_cls IN SELECT c FROM unnest({classes}::text[]) AS c ORDER BY random() LOOP
      v_scope := split_part(v_cls, '/', 1);
      v_key := split_part(v_cls, '/', 2) || i;
      t0 := clock_timestamp();
      SELECT r.outcome INTO v_out FROM {call} AS r;
      t1 := clock_timestamp();
      INSERT INTO timing VALUES (v_cls, extract(epoch FROM t1 - t0) * 1e6, v_out);
    END LOOP;
  END LOOP;
END $$""").format(last=sql.Literal(KEYS_PER_CLASS - 1),
                  classes=sql.Literal("{" + ",".join(classes) + "}"),
                  call=sql.SQL(call_sql.format(t=WRONG_TOKEN))))
    assert conn.execute("SELECT array_agg(DISTINCT outcome) FROM timing").fetchone()[0] == \
        ["lease_lost"]
    out: dict[str, list[float]] = {c: [] for c in classes}
    for cls, us in conn.execute("SELECT cls, us FROM timing"):
        out[cls].append(us)
    return out


@pytest.mark.parametrize("fn", sorted(OUTCOME_CALLS))
def test_no_timing_oracle_in_the_outcome_forms(server: Any, db: str, fn: str) -> None:
    """tests/probes/test_timing_oracle.py's bounds, for the outcome forms, as the request role (in a
    session with hostile settings: they change nothing the functions do)."""
    mine, other = "attacker", "victim"
    make_keys(db, (mine, other))
    classes = [f"{scope}/{state}" for scope in (mine, other) for state in (*STATES, "absent")]
    with login_roles(server, db, "request") as (role,), \
            psycopg.connect(db, user=role, autocommit=True) as conn:
        apply(conn, HOSTILE_SETTINGS[1])
        server_side(conn, OUTCOME_CALLS[fn], classes)  # warm up: plans, caches
        judge(lambda: server_side(conn, OUTCOME_CALLS[fn], classes), classes, fn)


async def test_package_argument_errors_name_the_outcome_function(any_flavour: Any) -> None:
    """What the package's heartbeat() and release() send is the outcome form: its argument
    errors (and the NULL scope the package refuses before sending, as the server would) name
    idempotency.heartbeat_outcome / release_outcome and the argument."""
    api, conn = any_flavour
    cases = [
        (lambda: api.heartbeat(conn, None, "k", 1), errors.ArgumentNull,
         "idempotency.heartbeat_outcome", "scope", None),
        (lambda: api.heartbeat(conn, "s", "k" * 256, 1), errors.ArgumentTooLong,
         "idempotency.heartbeat_outcome", "key", "IK012"),
        (lambda: api.heartbeat(conn, "s", "k", 1, lease=0), errors.ArgumentOutOfRange,
         "idempotency.heartbeat_outcome", "lease", "IK014"),
        (lambda: api.release(conn, None, "k", 1), errors.ArgumentNull,
         "idempotency.release_outcome", "scope", None),
        (lambda: api.release(conn, "", "k", 1), errors.ArgumentEmpty,
         "idempotency.release_outcome", "scope", "IK011"),
    ]
    for fn, cls, function, argument, sent in cases:
        with pytest.raises(cls) as info:
            await call(fn())
        e = info.value
        assert (e.function, e.argument) == (function, argument)
        # None: refused in the package, nothing sent; else the server's error
        assert (e.pgerror.sqlstate if e.pgerror is not None else None) == sent
        await rollback(conn)
