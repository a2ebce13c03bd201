"""The ways to install, and the environments the engine must survive.

* schema drift: build/sources.sql (the sql/ sources) and migrations/*.sql give the same schema;
* a migration applied twice;
* CREATE EXTENSION: lifecycle, membership of the partitions, pg_dump / restore, DROP EXTENSION;
* least privilege through a real login role granted with idempotency.grant_usage();
* an empty search_path, and a hostile one that shadows functions and operators the engine uses.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers import login_roles
from helpers.install import (
    INSTALL_ARGS,
    MIGRATIONS,
    executable,
    latest_extension_version,
    normalize_dump,
    pg_dump,
    reinstall_this_build,
    scratch_db,
)
from psycopg import sql
from psycopg.types.json import Jsonb

from pgharness import WAIT_BOUND, PgServer

ROOT = Path(__file__).resolve().parents[2]
SOURCES_SQL = ROOT / "build" / "sources.sql"
# What idempotency.migrations holds once every migration is applied: [(1, "0001_core"), ...].
MIGRATION_ROWS = [(int(p.stem[:4]), p.stem) for p in MIGRATIONS]

LIFECYCLE_CLAIM = """
SELECT outcome, lease_token, response_status, response_headers, response_body
FROM idempotency.claim(scope => %s, key => %s, request => %s::jsonb)
"""


# -- helpers ------------------------------------------------------------------------------------


def apply_migrations(server: PgServer, dsn: str) -> None:
    assert MIGRATIONS, "no migrations/*.sql"
    for migration in MIGRATIONS:
        server.run_psql(dsn, migration, args=INSTALL_ARGS)


def sources_sql() -> Path:
    if not SOURCES_SQL.exists():
        subprocess.run([sys.executable, str(ROOT / "tools" / "build.py")], check=True)
    return SOURCES_SQL


def run_lifecycle(conn: psycopg.Connection[Any], scope: str) -> None:
    """claim -> in_progress -> complete -> replay, mismatch, and the side functions."""
    request = {"amount": 50, "currency": "EUR"}
    outcome, token, *_ = conn.execute(LIFECYCLE_CLAIM, (scope, "k1", Jsonb(request))).fetchone()
    assert outcome == "claimed" and token is not None
    assert conn.execute(LIFECYCLE_CLAIM, (scope, "k1", Jsonb(request))).fetchone()[:2] == (
        "in_progress", None)
    conn.execute("SELECT idempotency.checkpoint(%s, 'k1', %s, 'charged')", (scope, token))
    conn.execute("SELECT idempotency.heartbeat(%s, 'k1', %s)", (scope, token))
    conn.execute("SELECT idempotency.complete(%s, 'k1', %s, 201, %s, %s)",
                 (scope, token, Jsonb({"id": 1}), Jsonb({"Location": "/p/1"})))
    assert conn.execute(LIFECYCLE_CLAIM, (scope, "k1", Jsonb({"currency": "EUR", "amount": 50.0}))
                        ).fetchone() == ("replay", None, 201, {"Location": "/p/1"}, {"id": 1})
    assert conn.execute(LIFECYCLE_CLAIM, (scope, "k1", Jsonb({"amount": 51}))
                        ).fetchone()[0] == "mismatch"
    # release and complete_bytes
    token = conn.execute(LIFECYCLE_CLAIM, (scope, "k2", Jsonb({}))).fetchone()[1]
    conn.execute("SELECT idempotency.release(%s, 'k2', %s)", (scope, token))
    token = conn.execute(LIFECYCLE_CLAIM, (scope, "k2", Jsonb({}))).fetchone()[1]
    assert token is not None
    conn.execute("SELECT idempotency.complete_bytes(%s, 'k2', %s, 200, '\\x2525'::bytea, "
                 "'application/pdf')", (scope, token))
    assert conn.execute(
        "SELECT outcome, response_body_bytes, response_content_type "
        "FROM idempotency.claim(%s, 'k2', '{}'::jsonb)", (scope,)
    ).fetchone() == ("replay", b"%%", "application/pdf")
    assert conn.execute("SELECT idempotency.inbox_accept(%s, 'm1')", (scope,)).fetchone()[0]
    assert not conn.execute("SELECT idempotency.inbox_accept(%s, 'm1')", (scope,)).fetchone()[0]
    assert len(conn.execute("SELECT idempotency.derive_key(%s, 'k1', 'charge')", (scope,)
                            ).fetchone()[0]) == 64
    if conn.execute("SELECT has_function_privilege("
                    "'idempotency.list_abandoned(integer, text, timestamptz)', 'EXECUTE')"
                    ).fetchone()[0]:  # a completer (or the owner); not a request role
        assert conn.execute("SELECT count(*) FROM idempotency.list_abandoned()"
                            ).fetchone()[0] == 0


def expect_sqlstate(conn: psycopg.Connection[Any], query: str, sqlstate: str,
                    params: Any = None) -> None:
    with pytest.raises(psycopg.Error) as info:
        conn.execute(query, params)
    assert info.value.sqlstate == sqlstate, (query, info.value.sqlstate, str(info.value))


# -- schema drift and re-application ------------------------------------------------------------


def test_sources_and_migrations_give_the_same_schema(server: PgServer, empty_db: str) -> None:
    with scratch_db(server, "drift") as migrated:
        server.run_psql(empty_db, sources_sql(), args=INSTALL_ARGS)
        apply_migrations(server, migrated)
        dumps = {}
        for label, dsn in (("sources", empty_db), ("migrations", migrated)):
            # Schema and data, except the migrations table's rows (only migrations insert them).
            dumps[label] = normalize_dump(pg_dump(
                server, dsn, "--schema=idempotency",
                "--exclude-table-data=idempotency.migrations"))
        with psycopg.connect(migrated) as conn:
            assert conn.execute("SELECT version, name FROM idempotency.migrations ORDER BY 1"
                                ).fetchall() == MIGRATION_ROWS
    assert "CREATE FUNCTION idempotency.claim(" in dumps["sources"]
    assert re.search(r"CREATE TABLE idempotency\.keys_p\d{8} ", dumps["sources"])
    diff = "\n".join(difflib.unified_diff(
        dumps["sources"].splitlines(), dumps["migrations"].splitlines(),
        "sources.sql", "migrations", lineterm="", n=2))
    assert not diff, f"schema drift between sql/ and migrations/:\n{diff[:6000]}"


def test_applying_the_migrations_twice_fails_loudly_and_changes_nothing(
    server: PgServer, db: str
) -> None:
    # Decided by reading 0001_core.sql: it starts with CREATE ... IF NOT EXISTS for the schema
    # and the migrations table, but every other object is a plain CREATE, so a second run must
    # stop at the first of them and roll the whole file back (-1).
    # From 0004 on a migration checks idempotency.migrations first and refuses to run again
    # (re-running 0004 after 0005 would otherwise put 0004's functions back).
    before = normalize_dump(pg_dump(server, db, "--schema=idempotency"))
    for migration in MIGRATIONS:
        proc = server.run_psql(db, migration, args=INSTALL_ARGS, check=False)
        assert proc.returncode == 3, (migration.name, proc.returncode, proc.stdout, proc.stderr)
        if int(migration.name[:4]) >= 4:
            assert f"migration {migration.stem} was already applied" in proc.stderr, proc.stderr
        else:
            assert "already exists" in proc.stderr, proc.stderr
    after = normalize_dump(pg_dump(server, db, "--schema=idempotency"))
    assert after == before, "a failed re-application must leave no trace"
    with psycopg.connect(db) as conn:
        assert conn.execute("SELECT version, name FROM idempotency.migrations ORDER BY 1"
                            ).fetchall() == MIGRATION_ROWS
        assert conn.execute("SELECT count(*) FROM idempotency.settings").fetchone()[0] == 1


# -- CREATE EXTENSION ---------------------------------------------------------------------------


PARTITION_RE = r"(keys|inbox)_p\d{8}"

MEMBERSHIP_SQL = """
SELECT c.relname,
       EXISTS (SELECT FROM pg_depend AS d
               JOIN pg_extension AS e ON e.oid = d.refobjid
               WHERE d.classid = 'pg_class'::regclass AND d.objid = c.oid
                 AND d.refclassid = 'pg_extension'::regclass AND d.deptype = 'e'
                 AND e.extname = 'pg_idempotency') AS member
FROM pg_class AS c
WHERE c.relnamespace = 'idempotency'::regnamespace AND c.relkind IN ('r', 'p', 'S')
ORDER BY 1
"""


def test_extension_lifecycle_and_partition_membership(server: PgServer, empty_db: str) -> None:
    with psycopg.connect(empty_db, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION pg_idempotency")
        # CREATE EXTENSION makes no ranged partitions (a restore would clash with the dumped
        # ones); docs/install.md has the operator run _premake() next.
        members = dict(conn.execute(MEMBERSHIP_SQL).fetchall())
        assert not [n for n in members if re.fullmatch(PARTITION_RE, n)], members
        assert conn.execute("SELECT idempotency._premake()").fetchone()[0] == 8
        run_lifecycle(conn, "ext")
        members = dict(conn.execute(MEMBERSHIP_SQL).fetchall())
        partitions = {n for n in members if re.fullmatch(PARTITION_RE, n)}
        # today and 3 ahead, for keys and inbox (the directory has no partitions since 0.9.0)
        assert len(partitions) == 8, members
        assert not any(members[p] for p in partitions), (
            f"partitions must not be extension members (pg_dump would skip their rows): "
            f"{members}")
        for code in ("keys", "inbox", "settings", "migrations", "key_directory"):
            assert members[code], f"{code} should belong to the extension: {members}"
        assert conn.execute("SELECT count(*) FROM idempotency.keys WHERE tableoid::regclass::text "
                            "~ '^idempotency.keys_p'").fetchone()[0] == 2


def test_extension_keys_in_the_default_partition_are_moved_by_maintain(
    server: PgServer, empty_db: str
) -> None:
    """After CREATE EXTENSION (no ranged partitions), claims land in keys_default; the first
    maintain() makes the partitions and moves those keys into them, as non-members."""
    reinstall_this_build(server)
    with psycopg.connect(empty_db, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION pg_idempotency")
        run_lifecycle(conn, "ext")
        assert conn.execute("SELECT DISTINCT tableoid::regclass::text FROM idempotency.keys"
                            ).fetchall() == [("idempotency.keys_default",)]
        steps = conn.execute("SELECT action, parent_table, row_count FROM idempotency.maintain()"
                             ).fetchall()
        assert ("moved", "keys", 2) in steps and ("moved", "inbox", 1) in steps, steps
        # 3 ahead for keys and inbox
        assert len([s for s in steps if s[0] == "created"]) == 6, steps
        assert conn.execute("SELECT count(*) FROM idempotency.keys_default").fetchone()[0] == 0
        members = dict(conn.execute(MEMBERSHIP_SQL).fetchall())
        partitions = [n for n in members if re.fullmatch(PARTITION_RE, n)]
        assert len(partitions) == 8 and not any(members[p] for p in partitions), members
        run_lifecycle(conn, "ext2")


def test_drop_extension_removes_everything(server: PgServer, empty_db: str) -> None:
    with psycopg.connect(empty_db, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION pg_idempotency")
        run_lifecycle(conn, "drop")
        conn.execute("DROP EXTENSION pg_idempotency")
        left = conn.execute("""
            SELECT 'schema ' || nspname FROM pg_namespace WHERE nspname = 'idempotency'
            UNION ALL
            SELECT 'relation ' || c.oid::regclass::text FROM pg_class AS c
            WHERE c.relname ~ '^(keys|inbox|settings|migrations|lease_token_seq)'
            UNION ALL
            SELECT 'type ' || typname FROM pg_type
            WHERE typname IN ('claim_result', 'abandoned_key')
            UNION ALL
            SELECT 'function ' || p.oid::regprocedure::text FROM pg_proc AS p
            WHERE p.proname IN ('claim', 'complete', '_premake', 'inbox_accept')
        """).fetchall()
        assert left == [], f"left behind by DROP EXTENSION: {left}"
        # And it installs again from scratch.
        conn.execute("CREATE EXTENSION pg_idempotency")
        assert conn.execute(LIFECYCLE_CLAIM, ("again", "k", Jsonb({}))).fetchone()[0] == "claimed"


class Dumped:
    """A database with the extension and some state, its pg_dump, and two restores of it."""

    def __init__(self) -> None:
        self.source = self.strict = self.lenient = ""
        self.strict_proc: subprocess.CompletedProcess[str] | None = None
        self.lenient_proc: subprocess.CompletedProcess[str] | None = None
        self.tokens: dict[str, int] = {}


@pytest.fixture(scope="module")
def dumped(server: PgServer) -> Iterator[Dumped]:
    """Source state: k-day completed (in a daily partition), k-default completed (in the default
    partition: created_at beyond the premade partitions, as after a few days without
    maintenance), k-stale in progress with an expired lease, an inbox message, and a changed
    setting. Restored with psql twice: strictly (-1, ON_ERROR_STOP) and leniently (the plain
    `psql -f dump.sql` of the pg_dump documentation)."""
    d = Dumped()
    with contextlib.ExitStack() as stack:
        d.source = stack.enter_context(scratch_db(server, "dump_src"))
        d.strict = stack.enter_context(scratch_db(server, "dump_strict"))
        d.lenient = stack.enter_context(scratch_db(server, "dump_lenient"))
        with psycopg.connect(d.source, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION pg_idempotency")
            conn.execute("SELECT idempotency._premake()")
            t = conn.execute(LIFECYCLE_CLAIM, ("dump", "k-day", Jsonb({"a": 1}))).fetchone()[1]
            conn.execute("SELECT idempotency.complete('dump', 'k-day', %s, 200, '{\"day\": 1}')",
                         (t,))
            later = conn.execute("SELECT now() + interval '30 days'").fetchone()[0]
            t = conn.execute("SELECT lease_token FROM idempotency.claim('dump', 'k-default', "
                             "'{\"a\": 2}', reference_time => %s)", (later,)).fetchone()[0]
            conn.execute("SELECT idempotency.complete('dump', 'k-default', %s, 200, "
                         "'{\"default\": 1}', reference_time => %s)", (t, later))
            past = conn.execute("SELECT now() - interval '1 minute'").fetchone()[0]
            d.tokens["k-stale"] = conn.execute(
                "SELECT lease_token FROM idempotency.claim('dump', 'k-stale', '{\"a\": 3}', "
                "lease => '1 second', reference_time => %s)", (past,)).fetchone()[0]
            d.tokens["max"] = conn.execute("SELECT max(lease_token) FROM idempotency.keys"
                                           ).fetchone()[0]
            assert conn.execute("SELECT idempotency.inbox_accept('dump', 'm1')").fetchone()[0]
            conn.execute("UPDATE idempotency.settings SET premake = 5, retention = '7 days'")
            where = dict(conn.execute("SELECT key, tableoid::regclass::text FROM idempotency.keys"
                                      ).fetchall())
            assert where["k-default"] == "idempotency.keys_default", where
            assert where["k-day"].startswith("idempotency.keys_p"), where
        dump = pg_dump(server, d.source)
        d.strict_proc = server.run_psql(d.strict, dump, args=INSTALL_ARGS, check=False)
        d.lenient_proc = server.run_psql(d.lenient, dump, args=("-X", "-q"), check=False)
        yield d


def _claim_in(dsn: str, key: str, request: dict[str, Any]) -> tuple[Any, ...]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(LIFECYCLE_CLAIM, ("dump", key, Jsonb(request))).fetchone()


@pytest.mark.xfail(strict=True, reason=(
    "known limitation: pg_dump emits ADD CONSTRAINT ... PRIMARY KEY for each partition of the "
    "extension-owned parent, but ATTACH PARTITION already made it ('multiple primary keys'); "
    "the restore loads every row when errors are not fatal (docs/install.md)"))
def test_extension_dump_restores_without_errors(dumped: Dumped) -> None:
    proc = dumped.strict_proc
    assert proc is not None
    assert proc.returncode == 0, (
        "restoring a pg_dump of a database with pg_idempotency in one transaction with "
        f"ON_ERROR_STOP failed:\n{proc.stderr[:3000]}")


def test_extension_dump_keeps_keys_of_daily_partitions(dumped: Dumped) -> None:
    assert _claim_in(dumped.lenient, "k-day", {"a": 1}) == ("replay", None, 200, {}, {"day": 1})


def test_extension_dump_keeps_keys_of_the_default_partition(dumped: Dumped) -> None:
    with psycopg.connect(dumped.lenient) as conn:
        row = conn.execute("SELECT key, state FROM idempotency.keys WHERE key = 'k-default'"
                           ).fetchall()
    assert row == [("k-default", "completed")], (
        "a key stored in idempotency.keys_default was lost by pg_dump / restore")


def test_extension_dump_keeps_fencing_tokens_increasing(dumped: Dumped) -> None:
    with psycopg.connect(dumped.lenient, autocommit=True) as conn:
        assert conn.execute("SELECT lease_token FROM idempotency.keys WHERE key = 'k-stale'"
                            ).fetchone()[0] == dumped.tokens["k-stale"]
        outcome, token, *_ = conn.execute(LIFECYCLE_CLAIM, ("dump", "k-stale", Jsonb({"a": 3}))
                                          ).fetchone()
    # Tokens grow per key from the row's own token (since 0.9.0 there is no sequence whose
    # position a restore could lose), so the takeover's token is above the stale owner's.
    assert outcome == "resumed"
    assert token > dumped.tokens["k-stale"], (
        f"after restore, takeover of k-stale got token {token} "
        f"(stale owner holds {dumped.tokens['k-stale']})")


def test_extension_dump_keeps_the_inbox(dumped: Dumped) -> None:
    with psycopg.connect(dumped.lenient, autocommit=True) as conn:
        assert conn.execute("SELECT idempotency.inbox_accept('dump', 'm1')").fetchone()[0] is False


def test_extension_dump_keeps_settings(dumped: Dumped) -> None:
    # settings is configuration the operator changed; it is marked with
    # pg_extension_config_dump, and its row is never made by the extension script.
    with psycopg.connect(dumped.lenient, autocommit=True) as conn:
        settings = conn.execute("SELECT premake, retention::text FROM idempotency.settings"
                                ).fetchall()
    assert settings == [(5, "7 days")], f"settings after restore: {settings}"


# -- least privilege ----------------------------------------------------------------------------


@pytest.fixture
def app_role(server: PgServer, db: str) -> Iterator[str]:
    """A LOGIN role (unique per test: roles are cluster-wide) granted grant_usage()."""
    role = f"app_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        conn.execute("SELECT idempotency.grant_usage(%s::regrole)", (role,))
    try:
        yield role
    finally:
        with psycopg.connect(db, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        with psycopg.connect(server.dsn("postgres"), autocommit=True) as conn:
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_least_privilege_login_role(db: str, app_role: str) -> None:
    with psycopg.connect(db, user=app_role, autocommit=True) as app:
        assert app.execute("SELECT current_user, usesuper FROM pg_user "
                           "WHERE usename = current_user").fetchone() == (app_role, False)
        run_lifecycle(app, "app")
        # The application role cannot move the engine's clock.
        past = app.execute("SELECT now() - interval '1 minute'").fetchone()[0]
        expect_sqlstate(app, "SELECT idempotency.claim('app', 'k3', '{}', "
                        "reference_time => %s)", "IK017", (past,))
        # A request role (grant_usage's default kind) cannot take over, even an expired lease.
        app.execute("SELECT idempotency.claim('app', 'k3', '{}', lease => '1 second')")
        time.sleep(1.1)
        expect_sqlstate(app, "SELECT outcome FROM idempotency.takeover('app', 'k3')", "42501")

        expect_sqlstate(app, "SELECT * FROM idempotency.keys", "42501")
        expect_sqlstate(app, "SELECT * FROM idempotency.keys_default", "42501")
        expect_sqlstate(app, "SELECT * FROM idempotency.inbox", "42501")
        expect_sqlstate(app, "SELECT * FROM idempotency.settings", "42501")
        expect_sqlstate(
            app, "INSERT INTO idempotency.keys (scope, key, fingerprint, state, lease_token, "
            "created_at) VALUES ('app', 'forged', '\\x00', 'completed', 1, now())", "42501")
        expect_sqlstate(app, "UPDATE idempotency.keys SET state = 'completed'", "42501")
        expect_sqlstate(app, "DELETE FROM idempotency.inbox", "42501")
        expect_sqlstate(app, "SELECT * FROM idempotency.key_directory", "42501")
        expect_sqlstate(app, "SELECT idempotency._premake(now())", "42501")
        expect_sqlstate(app, "SELECT idempotency._new_token(1)", "42501")
        expect_sqlstate(app, "SELECT idempotency.distribute()", "42501")
        # A fenced write with a token that is not the owner's still raises the documented code.
        expect_sqlstate(app, "SELECT idempotency.complete('app', 'k3', 1, 200, '{}')", "IK001")
    with psycopg.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM idempotency.keys WHERE scope = 'app'"
                            ).fetchone()[0] == 3
        assert conn.execute("SELECT count(*) FROM idempotency.keys WHERE key = 'forged'"
                            ).fetchone()[0] == 0


# -- request and completer roles ----------------------------------------------------------------

#: Added in 0011 (0.11.0): the fenced calls answering a lost lease as an outcome.
OUTCOME_FUNCTIONS = {"heartbeat_outcome", "checkpoint_outcome", "release_outcome"}
REQUEST_FUNCTIONS = {"accept", "canonical_json", "checkpoint", "claim", "complete",
                     "complete_bytes", "derive_key", "fingerprint", "heartbeat", "inbox_accept",
                     "release"} | OUTCOME_FUNCTIONS
COMPLETER_FUNCTIONS = (REQUEST_FUNCTIONS - {"claim", "inbox_accept"}) | {"takeover",
                                                                         "list_abandoned"}


def test_request_role_reads_only_keys_it_presents_with_their_request(
    server: PgServer, db: str
) -> None:
    with login_roles(server, db, "request", "request") as (tenant_a, attacker), \
            psycopg.connect(db, user=tenant_a, autocommit=True) as a, \
            psycopg.connect(db, user=attacker, autocommit=True) as evil:
        # Every function the request role can execute; each is tried below or only writes.
        assert executable(evil) == REQUEST_FUNCTIONS
        token = a.execute("SELECT lease_token FROM idempotency.claim('tenant-a', 'pay-1', "
                          "'{\"amount\": 10}', lease => '1 second')").fetchone()[0]
        a.execute("SELECT idempotency.complete('tenant-a', 'pay-1', %s, 201, "
                  "'{\"secret\": \"a-only\"}')", (token,))
        a.execute("SELECT idempotency.claim('tenant-a', 'pay-2', '{}', lease => '1 second')")
        time.sleep(1.1)  # pay-2's lease is abandoned now
        # Without the request: no stored response, whatever the call.
        for request in ("'{}'", "'{\"amount\": 11}'"):
            row = evil.execute(
                "SELECT outcome, response_status, response_body, response_body_bytes, "
                "response_headers FROM idempotency.claim('tenant-a', 'pay-1', "
                f"{request})").fetchone()
            assert row == ("mismatch", None, None, None, None)
        row = evil.execute("SELECT outcome, response_body FROM idempotency.claim("
                           "'tenant-a', 'pay-1', NULL, fingerprint => %s)",
                           (b"\x00" * 32,)).fetchone()
        assert row == ("mismatch", None)
        with pytest.raises(psycopg.Error) as err:
            evil.execute("SELECT idempotency.claim('tenant-a', 'pay-1', '{}', strict => true)")
        assert err.value.sqlstate == "IK002"
        with psycopg.connect(db) as owner:
            stored = owner.execute("SELECT encode(fingerprint, 'hex') FROM idempotency.keys "
                                   "WHERE key = 'pay-1'").fetchone()[0]
        assert stored not in str(err.value.diag.message_detail) + str(err.value)
        for query in ("SELECT * FROM idempotency.takeover('tenant-a', 'pay-1')",
                      "SELECT * FROM idempotency.takeover('tenant-a', 'pay-2')",
                      "SELECT * FROM idempotency.list_abandoned()",
                      "SELECT * FROM idempotency.list_abandoned(scope => 'tenant-a')",
                      "SELECT * FROM idempotency.key_status()",
                      "SELECT * FROM idempotency.partition_status()",
                      "SELECT * FROM idempotency.maintain()",
                      "SELECT idempotency._check_name('f', 'a', 'v')",
                      "SELECT idempotency._invalid_argument('f', 'a', 'IK010', 'x')",
                      "SELECT * FROM idempotency._lease_error('f', 'tenant-a', 'pay-1', 1)",
                      "SELECT idempotency.grant_usage(current_user::regrole, 'completer')"):
            expect_sqlstate(evil, query, "42501")
        # derive_key still works without EXECUTE on _check_name.
        assert len(evil.execute("SELECT idempotency.derive_key('s', 'k', 'x')").fetchone()[0]) == 64
        # Tenant A's own retry still replays its own answer, and pay-2 was not taken over.
        assert a.execute("SELECT outcome, response_body FROM idempotency.claim('tenant-a', "
                         "'pay-1', '{\"amount\": 10}')").fetchone() == (
                             "replay", {"secret": "a-only"})
        assert a.execute("SELECT outcome, attempts FROM idempotency.claim('tenant-a', 'pay-2', "
                         "'{}')").fetchone() == ("resumed", 2)


def test_completer_role_takes_over_and_finishes_abandoned_keys(server: PgServer, db: str) -> None:
    with login_roles(server, db, "request", "completer") as (handler, completer), \
            psycopg.connect(db, user=handler, autocommit=True) as h, \
            psycopg.connect(db, user=completer, autocommit=True) as c:
        assert executable(c) == COMPLETER_FUNCTIONS
        for scope in ("t1", "t2"):
            h.execute("SELECT idempotency.claim(%s, 'job', '{\"n\": 1}', lease => '1 second')",
                      (scope,))
        time.sleep(1.1)
        assert [r[0] for r in c.execute(
            "SELECT scope FROM idempotency.list_abandoned(scope => 't1')").fetchall()] == ["t1"]
        assert sorted(r[0] for r in c.execute(
            "SELECT scope FROM idempotency.list_abandoned()").fetchall()) == ["t1", "t2"]
        outcome, token = c.execute("SELECT outcome, lease_token FROM idempotency.takeover("
                                   "'t1', 'job')").fetchone()
        assert outcome == "resumed"
        c.execute("SELECT idempotency.heartbeat('t1', 'job', %s)", (token,))
        c.execute("SELECT idempotency.complete('t1', 'job', %s, 200, '{\"done\": 1}')", (token,))
        expect_sqlstate(c, "SELECT * FROM idempotency.claim('t1', 'job', '{\"n\": 1}')", "42501")
        expect_sqlstate(c, "SELECT idempotency.inbox_accept('c', 'm')", "42501")
        # The handler's retry replays what the completer stored.
        assert h.execute("SELECT outcome, response_body FROM idempotency.claim('t1', 'job', "
                         "'{\"n\": 1}')").fetchone() == ("replay", {"done": 1})
    with psycopg.connect(db, autocommit=True) as owner:
        for kind, sqlstate in (("admin", "IK014"), (None, "IK010")):
            expect_sqlstate(owner, "SELECT idempotency.grant_usage(current_user::regrole, %s)",
                            sqlstate, (kind,))


def test_roles_granted_before_0006_keep_their_functions_but_not_the_internals(
    server: PgServer,
) -> None:
    role = f"old_{uuid.uuid4().hex[:8]}"
    with scratch_db(server, "roles06") as dsn:
        for migration in MIGRATIONS[:5]:
            server.run_psql(dsn, migration, args=INSTALL_ARGS)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
            conn.execute("SELECT idempotency.grant_usage(%s::regrole)", (role,))
        try:
            server.run_psql(dsn, MIGRATIONS[5], args=INSTALL_ARGS)
            with psycopg.connect(dsn, user=role, autocommit=True) as old:
                assert executable(old) == \
                    (REQUEST_FUNCTIONS | COMPLETER_FUNCTIONS) - OUTCOME_FUNCTIONS  # up to 0006
                assert len(old.execute("SELECT idempotency.derive_key('s', 'k', 'x')"
                                       ).fetchone()[0]) == 64
                expect_sqlstate(old, "SELECT idempotency.derive_key('s', '', 'x')", "IK011")
        finally:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            with psycopg.connect(server.dsn("postgres"), autocommit=True) as conn:
                conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


# -- search_path --------------------------------------------------------------------------------


def test_lifecycle_with_an_empty_search_path(db: str) -> None:
    with psycopg.connect(db, autocommit=True, options="-c search_path=") as conn:
        assert conn.execute("SELECT current_setting('search_path')").fetchone()[0] in ("", '""')
        run_lifecycle(conn, "nopath")
        past = conn.execute("SELECT now() - interval '1 minute'").fetchone()[0]
        conn.execute("SELECT idempotency.claim('nopath', 'k3', '{}', lease => '1 second', "
                     "reference_time => %s)", (past,))
        assert conn.execute("SELECT count(*) FROM idempotency.list_abandoned()").fetchone()[0] == 1
        assert conn.execute("SELECT outcome FROM idempotency.takeover('nopath', 'k3')"
                            ).fetchone()[0] == "resumed"


HOSTILE_SQL = r"""
CREATE SCHEMA evil;
CREATE FUNCTION evil.sha256(bytea) RETURNS bytea LANGUAGE sql
    RETURN pg_catalog.decode(pg_catalog.repeat('ee', 32), 'hex');
CREATE FUNCTION evil.convert_to(text, name) RETURNS bytea LANGUAGE sql RETURN '\x00'::bytea;
CREATE FUNCTION evil.length(text) RETURNS integer LANGUAGE sql RETURN 0;
CREATE FUNCTION evil.trim_scale(numeric) RETURNS numeric LANGUAGE sql RETURN 0;
CREATE FUNCTION evil.jsonb_typeof(jsonb) RETURNS text LANGUAGE sql RETURN 'string';
CREATE FUNCTION evil.string_agg(text, text) RETURNS text LANGUAGE sql RETURN 'x';
CREATE FUNCTION evil.hashtext(text) RETURNS integer LANGUAGE sql RETURN 0;
CREATE FUNCTION evil.pg_advisory_xact_lock(integer, integer) RETURNS void LANGUAGE sql
    RETURN NULL;
CREATE FUNCTION evil.clock_timestamp() RETURNS timestamptz LANGUAGE sql
    RETURN '2000-01-01 00:00:00+00'::timestamptz;
CREATE FUNCTION evil.nextval(regclass) RETURNS bigint LANGUAGE sql RETURN 1;
CREATE FUNCTION evil.gen_random_uuid() RETURNS uuid LANGUAGE sql
    RETURN '00000000-0000-4000-8000-000000000000'::uuid;
CREATE FUNCTION evil.yes(bytea, bytea) RETURNS boolean LANGUAGE sql RETURN true;
CREATE FUNCTION evil.no(bytea, bytea) RETURNS boolean LANGUAGE sql RETURN false;
CREATE FUNCTION evil.cat(text, text) RETURNS text LANGUAGE sql RETURN 'x';
CREATE OPERATOR evil.= (LEFTARG = bytea, RIGHTARG = bytea, FUNCTION = evil.yes);
CREATE OPERATOR evil.<> (LEFTARG = bytea, RIGHTARG = bytea, FUNCTION = evil.no);
CREATE OPERATOR evil.|| (LEFTARG = text, RIGHTARG = text, FUNCTION = evil.cat);
GRANT USAGE ON SCHEMA evil TO public;
"""

HOSTILE_PATH = "-c search_path=evil,pg_catalog,public"


def test_claims_are_correct_under_a_hostile_search_path(server: PgServer, db: str) -> None:
    server.run_psql(db, HOSTILE_SQL)
    request = {"b": [1, 2.50, {"z": True, "y": None}], "a": "é\n", "n": 50.0}
    equivalent = {"n": 50, "a": "é\n", "b": [1, 2.5, {"y": None, "z": True}]}
    canonical = '{"a":"é\\n","b":[1,2.5,{"y":null,"z":true}],"n":50}'
    expected = hashlib.sha256(canonical.encode()).digest()

    with psycopg.connect(db, autocommit=True, options=HOSTILE_PATH) as evil:
        # The shadowing objects are live in this session ...
        assert evil.execute("SELECT length('abc'), sha256('\\x01'::bytea) = '\\x02'::bytea"
                            ).fetchone() == (0, True)
        # ... and the engine does not see them.
        assert bytes(evil.execute("SELECT idempotency.fingerprint(%s)", (Jsonb(request),)
                                  ).fetchone()[0]) == expected
        outcome, token, *_ = evil.execute(LIFECYCLE_CLAIM, ("hostile", "k1", Jsonb(request))
                                          ).fetchone()
        assert outcome == "claimed"
        assert evil.execute(LIFECYCLE_CLAIM, ("hostile", "k1", Jsonb({"n": 51}))
                            ).fetchone()[0] == "mismatch"
        assert evil.execute(LIFECYCLE_CLAIM, ("hostile", "k1", Jsonb(equivalent))
                            ).fetchone()[0] == "in_progress"
        evil.execute("SELECT idempotency.complete('hostile', 'k1', %s, 200, %s, %s)",
                     (token, Jsonb({"ok": 1}), Jsonb({"X-A": "b"})))
        assert evil.execute(LIFECYCLE_CLAIM, ("hostile", "k1", Jsonb(equivalent))
                            ).fetchone() == ("replay", None, 200, {"X-A": "b"}, {"ok": 1})
        second = evil.execute(LIFECYCLE_CLAIM, ("hostile", "k2", Jsonb({}))).fetchone()[1]
        # The tokens' random low bits come from pg_catalog.gen_random_uuid(), not from the
        # shadow (all zeros), and their high bits from the real clock (seconds since 2024).
        assert token & 0xFFFFFFFF and second & 0xFFFFFFFF and token != second
        assert abs((second >> 32) - (time.time() - 1704067200)) < 600
        run_lifecycle(evil, "hostile2")

        # The key lock is the real one: a claim of a key held by an open transaction waits.
        with psycopg.connect(db, options=HOSTILE_PATH) as holder:
            assert holder.execute(LIFECYCLE_CLAIM, ("hostile", "k3", Jsonb({}))
                                  ).fetchone()[0] == "claimed"
            evil.execute("SET lock_timeout = '200ms'")
            expect_sqlstate(evil, LIFECYCLE_CLAIM, "55P03", ("hostile", "k3", Jsonb({})))
            holder.rollback()

    with psycopg.connect(db) as conn:
        stored, fp, created_ok = conn.execute(
            "SELECT k.fingerprint, idempotency.fingerprint(%s), "
            "k.created_at > now() - interval '1 hour' "
            "FROM idempotency.keys AS k WHERE k.scope = 'hostile' AND k.key = 'k1'",
            (Jsonb(request),)).fetchone()
        assert bytes(stored) == bytes(fp) == expected
        assert created_ok, "created_at must come from the real clock_timestamp()"
        assert conn.execute("SELECT count(*) FROM idempotency.keys WHERE scope = 'hostile'"
                            ).fetchone()[0] == 2


def test_hostile_search_path_for_concurrent_claims(server: PgServer, db: str) -> None:
    """With pg_advisory_xact_lock and hashtext shadowed, 16 sessions claiming the same keys
    still produce one row and one claimed per key."""
    server.run_psql(db, HOSTILE_SQL)
    n, keys = 16, [f"h{i}" for i in range(20)]
    barrier = threading.Barrier(n, timeout=WAIT_BOUND)  # far beyond need: the machine may be busy
    outcomes: list[tuple[str, str]] = []
    errors: list[BaseException] = []

    def session() -> None:
        try:
            with psycopg.connect(db, autocommit=True, options=HOSTILE_PATH) as conn:
                barrier.wait()
                for k in keys:
                    outcomes.append((k, conn.execute(LIFECYCLE_CLAIM, ("hc", k, Jsonb({"v": 1}))
                                                     ).fetchone()[0]))
        except BaseException as exc:  # re-raised below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=session, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_BOUND)
    assert not [t for t in threads if t.is_alive()], \
        f"a session still claiming after {WAIT_BOUND} s"
    assert not errors, errors[0]
    claimed = sorted(k for k, o in outcomes if o == "claimed")
    assert claimed == sorted(keys)
    assert len(outcomes) == n * len(keys)
    with psycopg.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM idempotency.keys WHERE scope = 'hc'"
                            ).fetchone()[0] == len(keys)


# -- ALTER EXTENSION UPDATE ---------------------------------------------------------------------


CATALOG_SQL = """
SELECT 'function ' || p.oid::regprocedure::text || ' ' || md5(pg_get_functiondef(p.oid))
       || ' ' || coalesce(obj_description(p.oid, 'pg_proc'), '')
FROM pg_proc AS p WHERE p.pronamespace = 'idempotency'::regnamespace
UNION ALL
SELECT 'column ' || c.relname || '.' || a.attname || ' ' || format_type(a.atttypid, a.atttypmod)
       || ' ' || a.attnotnull || ' ' || coalesce(pg_get_expr(d.adbin, d.adrelid), '')
FROM pg_attribute AS a JOIN pg_class AS c ON c.oid = a.attrelid
LEFT JOIN pg_attrdef AS d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
WHERE c.relnamespace = 'idempotency'::regnamespace AND c.relkind IN ('r', 'p', 'c')
  AND c.relname !~ '_p[0-9]' AND a.attnum > 0 AND NOT a.attisdropped
UNION ALL
SELECT 'constraint ' || conrelid::regclass::text || ' ' || conname || ' '
       || pg_get_constraintdef(oid)
FROM pg_constraint WHERE connamespace = 'idempotency'::regnamespace
  AND conrelid::regclass::text !~ '_p[0-9]'
UNION ALL
SELECT 'member ' || pg_describe_object(classid, objid, 0) FROM pg_depend
WHERE refclassid = 'pg_extension'::regclass AND deptype = 'e'
  AND refobjid = (SELECT oid FROM pg_extension WHERE extname = 'pg_idempotency')
UNION ALL
SELECT 'config ' || unnest(extconfig)::regclass::text FROM pg_extension
WHERE extname = 'pg_idempotency'
ORDER BY 1
"""


def test_extension_update_from_0_1_0_equals_a_fresh_install(server: PgServer) -> None:
    reinstall_this_build(server)
    latest = latest_extension_version()
    assert latest != "0.1.0"
    with scratch_db(server, "ext_old") as old, scratch_db(server, "ext_new") as new:
        with psycopg.connect(old, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION pg_idempotency VERSION '0.1.0'")
            conn.execute("SELECT idempotency._premake()")
            run_lifecycle(conn, "old")
            conn.execute("UPDATE idempotency.settings SET retention = '2 days'")
            conn.execute("ALTER EXTENSION pg_idempotency UPDATE")
            assert conn.execute("SELECT extversion FROM pg_extension "
                                "WHERE extname = 'pg_idempotency'").fetchone()[0] == latest
            # The keys and settings of 0.1.0 are kept; the new settings take their defaults.
            assert conn.execute("SELECT outcome FROM idempotency.claim('old', 'k1', %s)",
                                (Jsonb({"amount": 50, "currency": "EUR"}),)).fetchone()[0] == (
                "replay")
            assert conn.execute("SELECT retention::text, tombstones, manage_partitions "
                                "FROM idempotency.settings").fetchone() == ("2 days", False, True)
            assert conn.execute("SELECT count(*) FROM idempotency.maintain()").fetchone()[0] >= 0
            updated = conn.execute(CATALOG_SQL).fetchall()
        with psycopg.connect(new, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION pg_idempotency")
            assert conn.execute("SELECT extversion FROM pg_extension "
                                "WHERE extname = 'pg_idempotency'").fetchone()[0] == latest
            # As on the updated one: maintain() makes the same partitions, and _make_routes()
            # the same generated functions for them.
            assert conn.execute("SELECT count(*) FROM idempotency.maintain()").fetchone()[0] > 0
            fresh = conn.execute(CATALOG_SQL).fetchall()
    assert ("config idempotency.tombstones_default",) in fresh
    diff = "\n".join(difflib.unified_diff([r[0] for r in fresh], [r[0] for r in updated],
                                          "CREATE EXTENSION", "0.1.0 + UPDATE", lineterm=""))
    assert not diff, f"the updated extension differs from a fresh one:\n{diff[:6000]}"


def test_distribute_without_citus_says_so(db: str) -> None:
    """On a server without Citus, distribute() raises IK021 and changes nothing."""
    with psycopg.connect(db, autocommit=True) as conn:
        expect_sqlstate(conn, "SELECT * FROM idempotency.distribute()", "IK021")
        assert conn.execute("SELECT count(*) FROM idempotency.keys").fetchone() == (0,)
        assert conn.execute("SELECT outcome FROM idempotency.claim('s', 'k', '{}')"
                            ).fetchone() == ("claimed",)


def test_no_immutable_function_reads_a_table(db: str) -> None:
    """An IMMUTABLE function's answer, value or error, depends on its arguments alone: the
    planner may fold it once and keep the answer (a cached plan, an index expression). So none
    reads idempotency.settings or calls _check_size, which does (fingerprint() and
    canonical_json() are STABLE since 0.11.0); and an index on fingerprint() is refused."""
    with psycopg.connect(db, autocommit=True) as conn:
        readers = conn.execute(
            "SELECT p.proname FROM pg_proc AS p "
            "WHERE p.pronamespace = 'idempotency'::regnamespace AND p.provolatile = 'i' "
            "  AND (p.prosrc ~ '_check_size' OR p.prosrc ~ 'idempotency\\.settings')"
            " ORDER BY 1").fetchall()
        assert readers == []
        volatility = dict(conn.execute(
            "SELECT proname, provolatile FROM pg_proc WHERE pronamespace = "
            "'idempotency'::regnamespace AND proname IN ('fingerprint', 'canonical_json', "
            "'_check_size', '_canonical_json')").fetchall())
        assert volatility == {"fingerprint": "s", "canonical_json": "s", "_check_size": "s",
                              "_canonical_json": "s"}
        conn.execute("CREATE TABLE public.bodies (body jsonb)")
        expect_sqlstate(conn, "CREATE INDEX ON public.bodies (idempotency.fingerprint(body))",
                        "42P17")
