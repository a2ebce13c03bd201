"""Bounds, server side (issue 34): every input has a limit, no argument empties the table.

* Size limits (settings.max_request_bytes, max_response_bytes, max_headers_bytes): a value at
  the limit is accepted, one byte over is refused with IK018 naming the argument, and nothing
  is written; called as the application roles. The backend's peak memory (VmHWM) for a call
  refused just over the limit stays close to one just under it, and a 200 MB body is refused
  without the engine adding to what the argument itself takes.
* Time arguments: every extreme reference_time (infinity, -infinity, 9998-12-31, 9999-01-01,
  294276-12-31, 1960-01-01 and both edges of the range) either runs, with every key still there
  and a handful of partitions made, or is refused with IK014 (never 22008), changing nothing.
  A reference_time ahead of the clock drops no key younger than the retention.
* On a Citus worker, the functions only the coordinator serves answer IK022 (never a raw
  42P01 / 42704), and the coordinator still runs them.
* docs/errors.md lists every SQLSTATE the engine's SQL sources can raise, and for each of its
  codes every public function that can raise it.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers import MIGRATION_PSQL_ARGS, MIGRATIONS, login_roles

from pgharness import PgServer

ROOT = Path(__file__).resolve().parents[2]
MIB = 1024 * 1024


def sqlstate_of(conn: psycopg.Connection[Any], query: str, params: Any = None
                ) -> tuple[str | None, str | None]:
    """(SQLSTATE, COLUMN) of the error query raises, (None, None) when it succeeds."""
    try:
        conn.execute(query, params)
    except psycopg.Error as exc:
        return exc.sqlstate, exc.diag.column_name
    return None, None


def json_of_size(conn: psycopg.Connection[Any], size: int) -> str:
    """JSON text of an object whose jsonb is exactly ``size`` bytes (pg_column_size)."""
    def measure(n: int) -> int:
        return conn.execute("SELECT pg_column_size(%s::jsonb)",
                            ('{"a": "' + "x" * n + '"}',)).fetchone()[0]
    n = size - measure(0)
    # A string's bytes are stored as they are: one more character, one more byte.
    assert measure(n) == size, (size, measure(n))
    return '{"a": "' + "x" * n + '"}'


def state(owner: psycopg.Connection[Any], scope: str, key: str) -> tuple[Any, ...] | None:
    return owner.execute(
        "SELECT k.state, k.response_status, k.response_body IS NULL, "
        "k.response_body_bytes IS NULL, k.response_headers FROM idempotency.keys AS k "
        "WHERE k.scope = %s AND k.key = %s", (scope, key)).fetchone()


# -- size limits --------------------------------------------------------------------------------

def test_settings_limits_have_safe_defaults_and_floors(db: str) -> None:
    with psycopg.connect(db, autocommit=True) as owner:
        owner.execute("SELECT idempotency._premake()")
        assert owner.execute(
            "SELECT max_request_bytes, max_response_bytes, max_headers_bytes "
            "FROM idempotency.settings").fetchone() == (MIB, MIB, 16384)
        # Below the floors the hot path never reads the row, so smaller limits are refused.
        for column, value in [("max_request_bytes", 65535), ("max_response_bytes", 65535),
                              ("max_headers_bytes", 4095), ("max_request_bytes", 2 ** 30 + 1)]:
            assert sqlstate_of(owner, f"UPDATE idempotency.settings SET {column} = %s",
                               (value,))[0] == "23514", column


def test_request_at_the_limit_is_claimed_one_byte_over_is_refused(server: PgServer,
                                                                   db: str) -> None:
    with psycopg.connect(db, autocommit=True) as owner, \
            login_roles(server, db, "request") as (role,), \
            psycopg.connect(db, user=role, autocommit=True) as app:
        owner.execute("SELECT idempotency._premake()")
        owner.execute("UPDATE idempotency.settings SET max_request_bytes = 65536")
        at, over = json_of_size(owner, 65536), json_of_size(owner, 65537)
        assert app.execute("SELECT outcome FROM idempotency.claim('s', 'at', %s::jsonb)",
                           (at,)).fetchone() == ("claimed",)
        try:
            app.execute("SELECT idempotency.claim('s', 'over', %s::jsonb)", (over,))
        except psycopg.Error as exc:
            assert (exc.sqlstate, exc.diag.column_name) == ("IK018", "request")
            assert exc.diag.message_primary == \
                'idempotency.claim: argument "request" is too large'
            assert exc.diag.message_detail == (
                "It is 65537 bytes; the limit (settings.max_request_bytes) is 65536 bytes.")
            assert "max_request_bytes" in (exc.diag.message_hint or "")
        else:
            pytest.fail("a request one byte over the limit was claimed")
        assert owner.execute(
            "SELECT (SELECT count(*) FROM idempotency.keys WHERE key = 'over'), "
            "(SELECT count(*) FROM idempotency.key_directory WHERE key_hash = sha256('over'))"
        ).fetchone() == (0, 0)
        # fingerprint() and canonical_json() measure the same way.
        assert len(app.execute("SELECT idempotency.fingerprint(%s::jsonb)", (at,)
                               ).fetchone()[0]) == 32
        assert sqlstate_of(app, "SELECT idempotency.fingerprint(%s::jsonb)", (over,)) == \
            ("IK018", "request")
        assert sqlstate_of(app, "SELECT idempotency.fingerprint('{}', %s::jsonb)", (over,)) == \
            ("IK018", "defaults")
        assert sqlstate_of(app, "SELECT idempotency.canonical_json(%s::jsonb)", (over,)) == \
            ("IK018", "value")
        assert sqlstate_of(app, "SELECT idempotency.canonical_json(%s::jsonb)", (at,)) == \
            (None, None)


def test_the_default_limit_refuses_a_mebibyte_and_one(server: PgServer, db: str) -> None:
    with psycopg.connect(db, autocommit=True) as owner, \
            login_roles(server, db, "request") as (role,), \
            psycopg.connect(db, user=role, autocommit=True) as app:
        # No settings row at all (before the first _premake()/maintain()) or the default row:
        # the same 1 MiB.
        over = json_of_size(owner, MIB + 1)
        for _ in range(2):
            assert sqlstate_of(app, "SELECT idempotency.claim('s', 'big', %s::jsonb)",
                               (over,)) == ("IK018", "request")
            owner.execute("SELECT idempotency._premake()")
        assert app.execute("SELECT outcome FROM idempotency.claim('s', 'big', %s::jsonb)",
                           (json_of_size(owner, MIB),)).fetchone() == ("claimed",)


@pytest.mark.parametrize("fn", ["complete", "complete_bytes", "accept"])
def test_response_and_headers_at_the_limit_are_stored_one_byte_over_nothing_is(
        server: PgServer, db: str, fn: str) -> None:
    with psycopg.connect(db, autocommit=True) as owner, \
            login_roles(server, db, "request") as (role,), \
            psycopg.connect(db, user=role, autocommit=True) as app:
        owner.execute("SELECT idempotency._premake()")
        owner.execute("UPDATE idempotency.settings SET max_response_bytes = 65536, "
                      "max_headers_bytes = 4096")

        def body(size: int) -> Any:
            return b"x" * size if fn == "complete_bytes" else json_of_size(owner, size)

        def headers(size: int) -> str:
            # A one-header object of exactly size bytes, measured like a body.
            n = size - owner.execute("SELECT pg_column_size('{\"X\": \"\"}'::jsonb)"
                                     ).fetchone()[0]
            text = '{"X": "' + "v" * n + '"}'
            assert owner.execute("SELECT pg_column_size(%s::jsonb)", (text,)).fetchone()[0] \
                == size
            return text

        call = {
            "complete": "SELECT idempotency.complete('s', %s, %s, 200, %s::jsonb, %s::jsonb)",
            "complete_bytes": "SELECT idempotency.complete_bytes('s', %s, %s, 200, %s::bytea, "
                              "'text/csv', %s::jsonb)",
            "accept": "SELECT idempotency.accept('s', %s, %s, 202, %s::jsonb, %s::jsonb)",
        }[fn]
        small_body = b"ok" if fn == "complete_bytes" else '{"ok": true}'
        for what, args in [("body", (body(65537), "{}")), ("headers", (small_body,
                                                                      headers(4097)))]:
            key = f"over-{what}"
            token = app.execute("SELECT lease_token FROM idempotency.claim('s', %s, '{}')",
                                (key,)).fetchone()[0]
            before = state(owner, "s", key)
            with app.transaction():
                app.execute("CREATE TEMPORARY TABLE IF NOT EXISTS business (n int)")
                app.execute("INSERT INTO business VALUES (1)")
                assert sqlstate_of(app, call, (key, token, *args)) == ("IK018", what)
                # The error aborted the business transaction: it rolls back as a whole.
                with pytest.raises(psycopg.errors.InFailedSqlTransaction):
                    app.execute("SELECT 1")
                raise psycopg.Rollback()
            assert state(owner, "s", key) == before == ("in_progress", None, True, True, None)
            # The holder still owns the key and completes it with a smaller answer.
            app.execute(call, (key, token, small_body, "{}"))
        key = "at-limit"
        token = app.execute("SELECT lease_token FROM idempotency.claim('s', %s, '{}')",
                            (key,)).fetchone()[0]
        app.execute(call, (key, token, body(65536), headers(4096)))
        stored = owner.execute(
            "SELECT coalesce(octet_length(k.response_body_bytes), "
            "pg_column_size(k.response_body)), pg_column_size(k.response_headers) "
            "FROM idempotency.keys AS k WHERE k.scope = 's' AND k.key = %s", (key,)).fetchone()
        assert stored[0] is not None and stored[1] is not None, stored


def vm(pid: int) -> dict[str, int]:
    """VmHWM and VmRSS of a process, in kB (the server runs as the same user as the tests)."""
    text = Path(f"/proc/{pid}/status").read_text()
    return {k: int(v) for k, v in re.findall(r"^(VmHWM|VmRSS):\s+(\d+) kB", text, re.M)}


def peak_growth(db: str, role: str, call: str, args: tuple[Any, ...]) -> tuple[int, str | None]:
    """(VmHWM growth in kB, SQLSTATE) of one call on a fresh backend, as role. The backend
    has pg_temp.bare(bytea) and pg_temp.bare(jsonb): PL/pgSQL functions that only measure
    their argument, the baseline of what any function call taking it costs."""
    with psycopg.connect(db, user=role, autocommit=True) as app:
        pid = app.execute("SELECT pg_backend_pid()").fetchone()[0]
        for t in ("bytea", "jsonb"):
            app.execute(f"CREATE FUNCTION pg_temp.bare(v {t}) RETURNS integer LANGUAGE plpgsql "
                        "AS $$BEGIN RETURN pg_column_size(v); END$$")
        app.execute("SELECT 1")
        before = vm(pid)["VmHWM"]
        code = sqlstate_of(app, call, args)[0]
        return vm(pid)["VmHWM"] - before, code


def test_backend_memory_is_bounded_at_and_over_the_limit(server: PgServer, db: str) -> None:
    """The argument itself is in the backend once (the protocol message and the datum): what
    the engine adds for a refused value is nothing, and a 200 MB body is refused with only
    the argument's own memory."""
    with psycopg.connect(db, autocommit=True) as owner, \
            login_roles(server, db, "request") as (role,), \
            psycopg.connect(db, user=role, autocommit=True) as app:
        owner.execute("SELECT idempotency._premake()")
        tokens = {k: app.execute("SELECT lease_token FROM idempotency.claim('m', %s, '{}')",
                                 (k,)).fetchone()[0] for k in ("under", "over", "huge")}
        call = ("SELECT idempotency.complete_bytes('m', %s, %s, 200, %b::bytea, "
                "'application/octet-stream')")
        under, code = peak_growth(db, role, call, ("under", tokens["under"], b"u" * MIB))
        assert code is None
        over, code = peak_growth(db, role, call, ("over", tokens["over"], b"o" * (MIB + 1)))
        assert code == "IK018"
        huge_size = 200 * MIB
        huge, code = peak_growth(db, role, call, ("huge", tokens["huge"], b"h" * huge_size))
        assert code == "IK018"
        # Just over the limit costs no more than just under it (which stores the body).
        assert over <= under + 2048, (under, over)
        # 200 MB: what the argument itself costs any function call that takes it (the
        # protocol message, the datum, its copies on the way into a function: about 4 x 200 MB
        # on PostgreSQL 15, for a bare PL/pgSQL function too); the engine adds nothing to it.
        # 0.11.0 before the limit spent 1.4 GB on a 200 MB JSON body, and stored it.
        bare, code = peak_growth(db, role, "SELECT pg_temp.bare(%b::bytea)",
                                 (b"h" * huge_size,))
        assert code is None
        assert huge <= bare + 8192, (huge, bare)
        print(f"VmHWM growth: 1 MiB stored {under} kB, 1 MiB + 1 refused {over} kB, "
              f"200 MB refused {huge} kB (a bare function: {bare} kB)")
        # JSON as well: the parse of the text into jsonb is PostgreSQL's (before the engine
        # runs); the engine adds nothing to it.
        jcall = "SELECT idempotency.complete('m', %s, %s, 200, %s::jsonb)"
        jhuge, code = peak_growth(db, role, jcall,
                                  ("huge", tokens["huge"], '"' + "j" * huge_size + '"'))
        assert code == "IK018"
        jbare, code = peak_growth(db, role, "SELECT pg_temp.bare(%s::jsonb)",
                                  ('"' + "j" * huge_size + '"',))
        assert code is None
        assert jhuge <= jbare + 8192, (jhuge, jbare)
        print(f"VmHWM growth: 200 MB JSON refused {jhuge} kB (a bare function: {jbare} kB)")
        assert state(owner, "m", "huge") == ("in_progress", None, True, True, None)


# -- time arguments ---------------------------------------------------------------------------

IN_RANGE = ["9998-12-31 00:00:00+00", "1970-01-01 00:00:00+00", "9998-12-31 23:59:59.999999+00"]
OUT_OF_RANGE = ["infinity", "-infinity", "9999-01-01 00:00:00+00", "294276-12-31 00:00:00+00",
                "1960-01-01 00:00:00+00", "1969-12-31 23:59:59.999999+00"]


def thirty_keys(owner: psycopg.Connection[Any]) -> None:
    owner.execute("SELECT idempotency._premake()")
    for i in range(30):
        token = owner.execute("SELECT lease_token FROM idempotency.claim('t', %s, '{}')",
                              (f"k{i}",)).fetchone()[0]
        owner.execute("SELECT idempotency.complete('t', %s, %s, 201, '{}')", (f"k{i}", token))


def partitions(owner: psycopg.Connection[Any]) -> list[str]:
    return [r[0] for r in owner.execute(
        "SELECT c.relname::text FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid "
        "WHERE i.inhparent IN ('idempotency.keys'::regclass, 'idempotency.inbox'::regclass, "
        "'idempotency.tombstones'::regclass) ORDER BY 1")]


@pytest.mark.parametrize("at", IN_RANGE)
def test_maintain_inside_the_range_keeps_the_newest_keys(db: str, at: str) -> None:
    with psycopg.connect(db, autocommit=True) as owner:
        thirty_keys(owner)
        owner.execute("UPDATE idempotency.settings SET tombstones = true")
        before = partitions(owner)
        steps = owner.execute("SELECT action, parent_table, partition_name, reason "
                              "FROM idempotency.maintain(%s::timestamptz)", (at,)).fetchall()
        assert owner.execute("SELECT count(*) FROM idempotency.keys WHERE scope = 't'"
                             ).fetchone() == (30,), steps
        # A retry of every key replays: nothing executes twice.
        assert {owner.execute("SELECT outcome FROM idempotency.claim('t', %s, '{}')",
                              (f"k{i}",)).fetchone()[0] for i in range(30)} == {"replay"}
        made = set(partitions(owner)) - set(before)
        # The current interval and settings.premake ahead, for keys, inbox and tombstones.
        assert len(made) <= 3 * 4, made
        if at.startswith("9998"):
            # What drops is measured from now(), not from 9998: nothing is due (before
            # 0.13.0 only the rule that keeps the newest rows' partition saved today's keys).
            assert not any(action == "dropped" for action, *_ in steps), steps
        # The run is recorded (metrics read it), with the time its drops were measured from:
        # the one it was given, or now() when that is later (a future time drops no key
        # younger than the retention).
        assert owner.execute("SELECT reference_time = least(%s::timestamptz, reference_time) "
                             "AND reference_time <= started_at FROM "
                             "idempotency.maintenance_runs ORDER BY id DESC LIMIT 1",
                             (at,)).fetchone() == (True,)


@pytest.mark.parametrize("at", ["now() + interval '2 days'", "'9998-12-31'::timestamptz"])
def test_a_future_reference_time_drops_no_key_younger_than_the_retention(db: str,
                                                                        at: str) -> None:
    """Retention 24 hours: 30 keys aged 0 to 23.9 hours all still replay after
    maintain(now() + 2 days) or maintain('9998-12-31') (before 0.13.0, 15 of 30 went), while
    the keys older than the retention go as before, their partitions dropped."""
    with psycopg.connect(db, autocommit=True) as owner:
        # Partitions from four days ago, as a maintain() then would have made them.
        owner.execute("SELECT idempotency._premake(now() - interval '4 days')")
        owner.execute("SELECT idempotency._premake()")
        ages = [f"{i * 23.9 / 29:.4f} hours" for i in range(30)]
        ages += ["50 hours", "70 hours", "80 hours"]
        for i, age in enumerate(ages):
            # The test clock (the schema owner's reference_time): created that long ago.
            owner.execute(
                "SELECT idempotency.complete('f', c.key, c.lease_token, 201, '{}', "
                "reference_time => now() - %s::interval) FROM (SELECT %s AS key, lease_token "
                "FROM idempotency.claim('f', %s, '{}', reference_time => now() - %s::interval)"
                ") AS c", (age, f"k{i}", f"k{i}", age))
        steps = owner.execute(f"SELECT action, partition_name, row_count "
                              f"FROM idempotency.maintain({at})").fetchall()
        outcomes = [owner.execute("SELECT outcome FROM idempotency.claim('f', %s, '{}')",
                                  (f"k{i}",)).fetchone()[0] for i in range(len(ages))]
        assert outcomes[:30] == ["replay"] * 30, (outcomes, steps)
        # Older than the retention (and than the partition holding the newest keys): gone,
        # each a new key again, by a partition drop.
        assert outcomes[30:] == ["claimed"] * 3, (outcomes, steps)
        dropped = sum(n for action, _, n in steps if action == "dropped")
        assert dropped == 3, steps
        # The run records the time its drops were measured from: now(), not the one given.
        assert owner.execute("SELECT reference_time <= started_at FROM "
                             "idempotency.maintenance_runs ORDER BY id DESC LIMIT 1"
                             ).fetchone() == (True,)


@pytest.mark.parametrize("at", OUT_OF_RANGE)
def test_maintain_outside_the_range_is_refused_and_changes_nothing(db: str, at: str) -> None:
    with psycopg.connect(db, autocommit=True) as owner:
        thirty_keys(owner)
        before = partitions(owner)
        try:
            owner.execute("SELECT * FROM idempotency.maintain(%s::timestamptz)", (at,))
        except psycopg.Error as exc:
            assert (exc.sqlstate, exc.diag.column_name) == ("IK014", "reference_time"), exc
            assert exc.diag.message_primary == ('idempotency.maintain: argument '
                                                '"reference_time" must be a finite time from '
                                                '1970 to 9998')
        else:
            pytest.fail(f"maintain({at}) ran")
        assert partitions(owner) == before
        assert owner.execute("SELECT count(*) FROM idempotency.keys").fetchone() == (30,)
        assert owner.execute("SELECT count(*) FROM idempotency.maintenance_runs"
                             ).fetchone() == (0,)


TIMED = {
    "claim": "SELECT idempotency.claim('t', 'x', '{}', reference_time => %s::timestamptz)",
    "complete": "SELECT idempotency.complete('t', 'k0', 1, 200, '{}', "
                "reference_time => %s::timestamptz)",
    "metrics": "SELECT idempotency.metrics(%s::timestamptz)",
    "metrics_by_scope": "SELECT * FROM idempotency.metrics_by_scope(%s::timestamptz)",
    "key_status": "SELECT * FROM idempotency.key_status(%s::timestamptz)",
    "partition_status": "SELECT * FROM idempotency.partition_status(%s::timestamptz)",
}


@pytest.mark.parametrize("fn", sorted(TIMED))
def test_every_reference_time_has_the_same_range(db: str, fn: str) -> None:
    with psycopg.connect(db, autocommit=True) as owner:
        thirty_keys(owner)
        for at in OUT_OF_RANGE:
            assert sqlstate_of(owner, TIMED[fn], (at,)) == ("IK014", "reference_time"), (fn, at)
        for at in IN_RANGE:
            code = sqlstate_of(owner, TIMED[fn], (at,))[0]
            # complete with a made-up token: the lease error, after the time was accepted.
            assert code in (None, "IK001"), (fn, at, code)
        assert owner.execute("SELECT count(*) FROM idempotency.keys WHERE scope = 't' "
                             "AND state = 'completed'").fetchone() == (30,)


# -- Citus: coordinator-only functions on a worker ----------------------------------------------

COORDINATOR_ONLY = {
    "maintain": "SELECT * FROM idempotency.maintain()",
    "metrics": "SELECT * FROM idempotency.metrics()",
    "metrics_by_scope": "SELECT * FROM idempotency.metrics_by_scope()",
    "key_status": "SELECT * FROM idempotency.key_status()",
    "partition_status": "SELECT * FROM idempotency.partition_status()",
    "distribute": "SELECT * FROM idempotency.distribute()",
}


def test_coordinator_only_functions_on_a_citus_worker_say_so(citus_cluster: Any) -> None:
    db = f"idem_bounds_{uuid.uuid4().hex[:8]}"
    dsn = citus_cluster.create_database(db)
    try:
        for migration in sorted(MIGRATIONS.glob("*.sql")):
            citus_cluster.coordinator.run_psql(dsn, migration, args=MIGRATION_PSQL_ARGS)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SELECT * FROM idempotency.distribute(4)")
            conn.execute("SELECT idempotency.claim('c', 'k', '{}')")
        for worker in citus_cluster.workers:
            with psycopg.connect(worker.dsn(db), autocommit=True) as conn:
                for fn, query in COORDINATOR_ONLY.items():
                    try:
                        conn.execute(query)
                    except psycopg.Error as exc:
                        assert exc.sqlstate == "IK022", (fn, exc.sqlstate, str(exc))
                        assert exc.diag.message_primary == (
                            f"idempotency.{fn}: this node is not the Citus coordinator"), exc
                        assert "coordinator" in (exc.diag.message_hint or "")
                    else:
                        pytest.fail(f"{fn} ran on a worker")
        with psycopg.connect(dsn, autocommit=True) as conn:
            for query in COORDINATOR_ONLY.values():
                conn.execute(query)
            assert ("c", "in_progress", 1) in [r[:3] for r in conn.execute(
                "SELECT * FROM idempotency.key_status()")]
    finally:
        citus_cluster.drop_database(db)


# -- docs/errors.md -----------------------------------------------------------------------------

def documented_sqlstates() -> set[str]:
    text = (ROOT / "docs" / "errors.md").read_text()
    return set(re.findall(r"^\| `([0-9A-Z]{5})` \|", text, re.MULTILINE))


def raised_codes(text: str) -> set[str]:
    """The SQLSTATEs a SQL source raises itself: ERRCODE = '...', and the code passed to
    _invalid_argument(fn, argument, 'IK0xx', ...)."""
    return set(re.findall(r"ERRCODE = '([0-9A-Z]{5})'", text)) | set(
        re.findall(r"'(IK\d{3})'", text))


def public_raisers() -> dict[str, set[str]]:
    """Per SQLSTATE, the public functions (no leading _) whose source, or an internal function
    it calls (idempotency._name(...)), directly or not, raises it."""
    texts = {p.stem: p.read_text() for p in (ROOT / "sql" / "functions").glob("*.sql")}
    calls = {name: set(re.findall(r"idempotency\.(_\w+)\(", text)) & set(texts)
             for name, text in texts.items()}

    def reach(name: str, seen: set[str]) -> set[str]:
        if name in seen:
            return set()
        seen.add(name)
        codes = raised_codes(texts[name])
        for callee in calls[name]:
            codes |= reach(callee, seen)
        return codes

    raisers: dict[str, set[str]] = {}
    for name in texts:
        if not name.startswith("_"):
            for code in reach(name, set()):
                raisers.setdefault(code, set()).add(name)
    return raisers


def documented_raisers() -> dict[str, str]:
    """Per SQLSTATE of errors.md's first table, its "Raised by" cell."""
    text = (ROOT / "docs" / "errors.md").read_text()
    return dict(re.findall(r"^\| `(IK\d{3})` \| \w+ \| ([^|]*) \|", text, re.MULTILINE))


def test_errors_md_names_every_function_that_raises_each_code() -> None:
    """errors.md's "Raised by" of each IK code names exactly the public functions that can
    raise it (through any internal function they call), or says "all" (IK010 to IK013: every
    function that takes such an argument). It once left out heartbeat_outcome and
    checkpoint_outcome for IK014."""
    raisers = public_raisers()
    documented = documented_raisers()
    public = {p.stem for p in (ROOT / "sql" / "functions").glob("*.sql")
              if not p.stem.startswith("_")}
    assert set(raisers) <= set(documented), sorted(set(raisers) - set(documented))
    for code, cell in sorted(documented.items()):
        if cell.strip() == "all":
            assert code in {"IK010", "IK011", "IK012", "IK013"}, code
            continue
        named = set(re.findall(r"\b[a-z_]+\b", cell)) & public
        assert named == raisers.get(code, set()), (
            code, "not listed:", sorted(raisers.get(code, set()) - named),
            "listed, never raised:", sorted(named - raisers.get(code, set())))


def test_every_sqlstate_the_sql_sources_raise_is_documented() -> None:
    raised: dict[str, set[str]] = {}
    for path in sorted((ROOT / "sql" / "functions").glob("*.sql")):
        for code in raised_codes(path.read_text()):
            raised.setdefault(code, set()).add(path.stem)
    assert {"IK018", "IK022", "IK014", "IK001"} <= set(raised), raised
    missing = {c: sorted(f) for c, f in raised.items() if c not in documented_sqlstates()}
    assert not missing, f"raised by the SQL sources but not in docs/errors.md: {missing}"
    # The codes PostgreSQL raises that errors.md promises (its second table), among them the
    # two the engine itself no longer reaches.
    assert {"54000", "22008", "22P02", "42501"} <= documented_sqlstates()
