"""A LOGIN role granted kind 'maintainer' (docs/install.md, Privileges) does a scheduler's job:
pg-idempotency maintain and status, the Python API behind them, with hostile session settings
that do not help it. tests/sql/41_maintainer.sql checks what it is refused, function by
function; tests/sql/test_pg_cron.py has pg_cron run its job.
"""

from __future__ import annotations

import json
import re
import textwrap
from collections.abc import Iterator
from datetime import timedelta

import psycopg
import pytest
from helpers import ROOT, login_roles
from helpers.api import run as cli
from helpers.probes import HOSTILE_SETTINGS, apply
from psycopg import sql
from psycopg.conninfo import make_conninfo
from psycopg.types.json import Jsonb

from pg_idempotency import maintenance
from pgharness import PgServer


@pytest.fixture
def maintainer(server: PgServer, db: str) -> Iterator[str]:
    with login_roles(server, db, "maintainer") as (role,):
        yield role


def role_dsn(db: str, role: str) -> str:
    return make_conninfo(db, user=role)


def expired_partition(db: str, scope: str) -> str:
    """A keys partition of six days ago holding one completed key (due for a drop), and a key
    claimed now beside it (maintain() never drops the newest interval holding rows)."""
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute("SELECT idempotency.claim(%s, 'now', '{}')", (scope,))
        lo = conn.execute("SELECT date_bin('1 day', now() - interval '6 days', "
                          "timestamptz '2000-01-01 00:00:00+00')").fetchone()[0]
        conn.execute("SELECT idempotency._create_partition('keys', %s, %s)",
                     (lo, lo + timedelta(days=1)))
        token = conn.execute("SELECT lease_token FROM idempotency.claim(%s, 'old', %s, "
                             "reference_time => %s)", (scope, Jsonb({}), lo)).fetchone()[0]
        conn.execute("SELECT idempotency.complete(%s, 'old', %s, 200, '{}', "
                     "reference_time => %s)", (scope, token, lo + timedelta(seconds=1)))
        return conn.execute("SELECT tableoid::regclass::text FROM idempotency.keys "
                            "WHERE scope = %s AND key = 'old'", (scope,)).fetchone()[0]


def exists(db: str, name: str) -> bool:
    with psycopg.connect(db, autocommit=True) as conn:
        return conn.execute("SELECT to_regclass(%s) IS NOT NULL", (name,)).fetchone()[0]


def test_the_cli_maintains_and_reports_as_a_maintainer(
    db: str, maintainer: str
) -> None:
    name = expired_partition(db, "cli")
    dsn = role_dsn(db, maintainer)
    done = cli("maintain", "--dsn", dsn)
    assert done.returncode == 0, done.stderr
    assert name.removeprefix("idempotency.") in done.stdout
    assert not exists(db, name)
    status = cli("status", "--dsn", dsn, "--json")
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert report["schema"]
    assert [(s["keys"], s["in_progress"], s["oldest_in_progress_key"])
            for s in report["scopes"] if s["scope"] == "cli"] == [(1, 1, "now")]
    assert any(p["parent_table"] == "keys" for p in report["partitions"])
    # Key inspection and repair are the owner's: the CLI says so.
    refused = cli("keys", "--dsn", dsn, "show", "cli", "now")
    assert refused.returncode == 1
    assert "SQLSTATE 42501" in refused.stderr


def test_hostile_settings_do_not_widen_a_maintainer(
    server: PgServer, db: str, maintainer: str
) -> None:
    name = expired_partition(db, "hostile")
    with psycopg.connect(db, autocommit=True) as conn:
        owner = conn.execute("SELECT nspowner::regrole::text FROM pg_namespace "
                             "WHERE nspname = 'idempotency'").fetchone()[0]
        settings_before = conn.execute("SELECT s::text FROM idempotency.settings AS s"
                                       ).fetchone()[0]
        runs_before = conn.execute("SELECT count(*) FROM idempotency.maintenance_runs"
                                   ).fetchone()[0]
        yesterday = conn.execute("SELECT now() - interval '1 day'").fetchone()[0]
    with psycopg.connect(role_dsn(db, maintainer), autocommit=True) as conn:
        apply(conn, HOSTILE_SETTINGS[1])
        # Look-alikes of what maintain() reads and writes, first on the search_path.
        for table in ("settings", "keys", "maintenance_runs", "grants"):
            conn.execute(sql.SQL("CREATE TEMP TABLE {} (id int)").format(sql.Identifier(table)))
        conn.execute("SET search_path = pg_temp, public, idempotency")
        conn.execute("SET lock_timeout = '1ms'")
        # It cannot become the owner, so the owner's test clock stays out of reach.
        for query in (sql.SQL("SET ROLE {}").format(sql.Identifier(owner)),
                      sql.SQL("SET SESSION AUTHORIZATION {}").format(sql.Identifier(owner))):
            with pytest.raises(psycopg.Error) as info:
                conn.execute(query)
            assert info.value.sqlstate == "42501"
        with pytest.raises(psycopg.Error) as info:
            maintenance.run_maintenance(conn, reference_time=yesterday)
        assert info.value.sqlstate == "IK017"
        steps = maintenance.run_maintenance(conn)
        assert [(s.action, s.partition_name) for s in steps if s.action == "dropped"] == [
            ("dropped", name.removeprefix("idempotency."))]
        for query in ("UPDATE idempotency.settings SET retention = '1 hour'",
                      "SELECT idempotency.force_release('hostile', 'now')",
                      "SELECT idempotency._maintain(now() - interval '1 year')",
                      f"SELECT idempotency.grant_usage('{maintainer}', 'request')"):
            with pytest.raises(psycopg.Error) as info:
                conn.execute(query)
            assert info.value.sqlstate == "42501", query
        assert conn.execute("SELECT count(*) FROM pg_temp.maintenance_runs").fetchone()[0] == 0
    assert not exists(db, name)
    with psycopg.connect(db, autocommit=True) as conn:
        assert conn.execute("SELECT s::text FROM idempotency.settings AS s").fetchone()[0] == (
            settings_before)
        assert conn.execute("SELECT count(*), max(outcome) FILTER (WHERE id = (SELECT max(id) "
                            "FROM idempotency.maintenance_runs)) "
                            "FROM idempotency.maintenance_runs").fetchone() == (
            runs_before + 1, "ok")
        assert conn.execute("SELECT kind FROM idempotency.grants WHERE grantee = %s::regrole",
                            (maintainer,)).fetchall() == [("maintainer",)]
        assert conn.execute("SELECT count(*) FROM idempotency.keys WHERE scope = 'hostile'"
                            ).fetchone()[0] == 1


def install_md_revoke() -> str:
    """docs/install.md's block (Privileges) that takes the maintainer kind back."""
    text = (ROOT / "docs" / "install.md").read_text()
    found = re.findall(r"^(    REVOKE EXECUTE ON FUNCTION idempotency\.maintain\(.*?)\n\n", text,
                       re.M | re.S)
    assert len(found) == 1, found
    return textwrap.dedent(found[0])


def test_revoking_the_kind_takes_everything_back(db: str, maintainer: str) -> None:
    """The REVOKE of docs/install.md, Privileges, as written there, for this role."""
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute(install_md_revoke().replace("payments_maintenance", maintainer))
        assert conn.execute("SELECT count(*) FROM idempotency.grants WHERE grantee = %s::regrole",
                            (maintainer,)).fetchone()[0] == 0
        # What a later migration does: the deleted row is not granted again.
        conn.execute("SELECT idempotency._reapply_grants()")
    with psycopg.connect(role_dsn(db, maintainer), autocommit=True) as conn:
        assert conn.execute(
            "SELECT count(*) FROM pg_proc AS p WHERE p.pronamespace = 'idempotency'::regnamespace "
            "AND has_function_privilege(p.oid, 'EXECUTE')").fetchone()[0] == 0
        for query in ("SELECT * FROM idempotency.maintain()",
                      "SELECT count(*) FROM idempotency.maintenance_runs"):
            with pytest.raises(psycopg.Error) as info:
                conn.execute(query)
            assert info.value.sqlstate == "42501", query
