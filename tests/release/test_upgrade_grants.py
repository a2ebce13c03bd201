"""Upgrades keep working for the roles already granted: a role let in with grant_usage() at any
released version calls every function of its kind after upgrading to the latest, by the plain
migrations and by ALTER EXTENSION ... UPDATE (docs/install.md, Privileges). The expected
functions are what grant_usage() gives a role on a fresh install today, so a function a later
migration adds is covered without editing this test.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from helpers.install import (
    INSTALL_ARGS,
    MIGRATIONS,
    executable,
    latest_extension_version,
    reinstall_this_build,
    scratch_db,
)
from psycopg import sql
from psycopg.types.json import Jsonb

from pgharness import PgServer

# grant_usage(grantee, kind) arrived in 0006; before it grant_usage(grantee) granted everything.
KINDS_FROM = 6
OLD_VERSIONS = list(range(1, len(MIGRATIONS)))


@contextlib.contextmanager
def roles(server: PgServer, dsn: str, count: int) -> Iterator[list[str]]:
    names = [f"up_{uuid.uuid4().hex[:10]}" for _ in range(count)]
    with psycopg.connect(dsn, autocommit=True) as conn:
        for name in names:
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
    try:
        yield names
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            for name in names:
                conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
        with psycopg.connect(server.dsn("postgres"), autocommit=True) as conn:
            for name in names:
                conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def grant(dsn: str, role: str, kind: str | None) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        if kind is None:
            conn.execute("SELECT idempotency.grant_usage(%s::regrole)", (role,))
        else:
            conn.execute("SELECT idempotency.grant_usage(%s::regrole, kind => %s)", (role, kind))


def functions_of(dsn: str, role: str) -> set[str]:
    with psycopg.connect(dsn, user=role, autocommit=True) as conn:
        return executable(conn)


@pytest.fixture(scope="module")
def expected(server: PgServer) -> dict[str, set[str]]:
    """What each kind can execute on a fresh install of the latest version."""
    with scratch_db(server, "grants_now") as dsn, roles(server, dsn, 3) as names:
        for migration in MIGRATIONS:
            server.run_psql(dsn, migration, args=INSTALL_ARGS)
        kinds = ["request", "completer", "monitor"]
        for role, kind in zip(names, kinds, strict=True):
            grant(dsn, role, kind)
        return {kind: functions_of(dsn, role) for role, kind in zip(names, kinds, strict=True)}


def lifecycle_as(dsn: str, role: str, scope: str) -> None:
    """claim -> accept (0003) -> complete -> replay, as the application role."""
    with psycopg.connect(dsn, user=role, autocommit=True) as conn:
        outcome, token = conn.execute(
            "SELECT outcome, lease_token FROM idempotency.claim(%s, 'k', %s)",
            (scope, Jsonb({"a": 1}))).fetchone()
        assert outcome == "claimed"
        conn.execute("SELECT idempotency.accept(%s, 'k', %s, 202, '{}')", (scope, token))
        conn.execute("SELECT idempotency.complete(%s, 'k', %s, 201, '{\"id\": 1}')",
                     (scope, token))
        assert conn.execute("SELECT outcome, response_status FROM idempotency.claim(%s, 'k', %s)",
                            (scope, Jsonb({"a": 1}))).fetchone() == ("replay", 201)


def check_after_upgrade(dsn: str, version: int, granted: dict[str, str | None],
                        expected: dict[str, set[str]]) -> None:
    for role, kind in granted.items():
        have = functions_of(dsn, role)
        if kind is None:
            # Granted before 0006: every function it had, so both kinds now (docs/install.md).
            want = expected["request"] | expected["completer"]
        else:
            want = expected[kind]
        assert have == want, (f"role granted {kind or 'by the old grant_usage'} at "
                              f"{version:04d}: missing {sorted(want - have)}, "
                              f"extra {sorted(have - want)}")
        if kind in (None, "request"):
            lifecycle_as(dsn, role, f"v{version}")


def kinds_at(version: int) -> list[str | None]:
    return ["request", "completer"] if version >= KINDS_FROM else [None]


@pytest.mark.parametrize("version", OLD_VERSIONS, ids=[f"from_{v:04d}" for v in OLD_VERSIONS])
def test_roles_granted_at_an_old_version_keep_their_kind_after_the_migrations(
    server: PgServer, expected: dict[str, set[str]], version: int
) -> None:
    kinds = kinds_at(version)
    with scratch_db(server, f"grants_m{version}") as dsn, \
            roles(server, dsn, len(kinds)) as names:
        for migration in MIGRATIONS[:version]:
            server.run_psql(dsn, migration, args=INSTALL_ARGS)
        granted = dict(zip(names, kinds, strict=True))
        for role, kind in granted.items():
            grant(dsn, role, kind)
        for migration in MIGRATIONS[version:]:
            server.run_psql(dsn, migration, args=INSTALL_ARGS)
        check_after_upgrade(dsn, version, granted, expected)


def test_roles_granted_at_every_old_version_keep_their_kind_after_alter_extension(
    server: PgServer, expected: dict[str, set[str]]
) -> None:
    reinstall_this_build(server)
    latest = latest_extension_version()
    for version in OLD_VERSIONS:
        kinds = kinds_at(version)
        with scratch_db(server, f"grants_x{version}") as dsn, \
                roles(server, dsn, len(kinds)) as names:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("CREATE EXTENSION pg_idempotency VERSION '0.1.0'")
                conn.execute("SELECT idempotency._premake()")
                if version > 1:
                    conn.execute(sql.SQL("ALTER EXTENSION pg_idempotency UPDATE TO {}").format(
                        sql.Literal(f"0.{version}.0")))
            granted = dict(zip(names, kinds, strict=True))
            for role, kind in granted.items():
                grant(dsn, role, kind)
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("ALTER EXTENSION pg_idempotency UPDATE")
                assert conn.execute("SELECT extversion FROM pg_extension WHERE extname = "
                                    "'pg_idempotency'").fetchone()[0] == latest
            check_after_upgrade(dsn, version, granted, expected)


def test_a_grant_is_recorded_and_reapplied_to_a_function_made_again(
    server: PgServer, db: str, expected: dict[str, set[str]]
) -> None:
    """What a later migration does when it drops and re-creates a function (0006 did so with
    grant_usage, 0008 with the routes): the EXECUTE grant goes with the old function, and the
    migration's closing _reapply_grants() gives it back."""
    with roles(server, db, 3) as (api, scraper, scheduler):
        grant(db, api, "request")
        grant(db, scraper, "monitor")
        grant(db, scheduler, "maintainer")
        before = functions_of(db, scheduler)
        assert {"maintain", "schedule_maintenance", "partition_status"} <= before
        with psycopg.connect(db, autocommit=True) as conn:
            assert sorted(conn.execute(
                "SELECT grantee::text, kind FROM idempotency.grants WHERE grantee::text IN "
                "(%s, %s)", (api, scraper)).fetchall()) == sorted(
                [(api, "request"), (scraper, "monitor")])
            # Simulate a migration that re-creates release() and maintain().
            for function in ("release(text, text, bigint)", "maintain(timestamptz)"):
                definition = conn.execute(
                    "SELECT pg_get_functiondef(%s::regprocedure)",
                    (f"idempotency.{function}",)).fetchone()[0]
                conn.execute(f"DROP FUNCTION idempotency.{function}")
                conn.execute(definition)
                conn.execute(f"REVOKE ALL ON FUNCTION idempotency.{function} FROM public")
        assert "release" not in functions_of(db, api)
        assert "maintain" not in functions_of(db, scheduler)
        with psycopg.connect(db, autocommit=True) as conn:
            assert conn.execute("SELECT idempotency._reapply_grants()").fetchone()[0] >= 3
        assert functions_of(db, api) == expected["request"]
        assert functions_of(db, scraper) == expected["monitor"] == {"metrics",
                                                                    "metrics_by_scope"}
        assert functions_of(db, scheduler) == before


def test_grant_usage_refuses_an_unknown_kind(db: str) -> None:
    with psycopg.connect(db, autocommit=True) as conn:
        with pytest.raises(psycopg.Error) as info:
            conn.execute("SELECT idempotency.grant_usage('postgres', kind => 'admin')")
        assert info.value.sqlstate == "IK014"
        assert "'request', 'completer', 'monitor' or 'maintainer'" in str(info.value)
