"""The installed console script .venv/bin/pg-idempotency, run as users run it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg
import pytest
from helpers import login_roles
from helpers.api import run
from psycopg import sql

import pg_idempotency as idem
from pg_idempotency import cli
from pg_idempotency.migrate import RESTORE_SEARCH_PATH, SAVE_SEARCH_PATH
from pgharness import PgServer, flavour_bindir

ROOT = Path(__file__).resolve().parents[2]
CLI = Path(sys.executable).parent / "pg-idempotency"
MIGRATIONS = sorted((ROOT / "migrations").glob("*.sql"))


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("pg-idempotency: ")
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert proc.stdout == ""


def closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the socket is


def test_console_script_is_installed() -> None:
    assert CLI.exists(), f"{CLI}: run make test (or pip install .) first"


def test_sql_path_prints_the_installed_migrations_folder() -> None:
    """What docs/install.md's RunSQL and Alembic recipes read: the installed package's own
    files, byte-identical to migrations/ (the venv's package is installed, not editable)."""
    from pg_idempotency.migrate import sql_path

    proc = run("sql-path")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    folder = Path(proc.stdout.strip())
    assert proc.stdout == f"{folder}\n" and folder == sql_path()
    assert folder.parent.name == "pg_idempotency" and "site-packages" in folder.parts, folder
    assert [f.name for f in sorted(folder.glob("*.sql"))] == [f.name for f in MIGRATIONS]
    for f in MIGRATIONS:
        assert (folder / f.name).read_bytes() == f.read_bytes(), f.name


@pytest.mark.parametrize(
    "args, needles",
    [
        ((), ["migrate", "sql", "--version", "--dsn", "DATABASE_URL"]),
        (("migrate",), ["--dsn", "DATABASE_URL", "up to date"]),
        (("sql",), ["psql", "idempotency.migrations"]),
        (("maintain",), ["--dsn", "DATABASE_URL", "retention", "--attempts", "Exit status 3"]),
        (("status",), ["--dsn", "DATABASE_URL", "next drop"]),
    ],
    ids=["main", "migrate", "sql", "maintain", "status"],
)
def test_help(args: tuple[str, ...], needles: list[str]) -> None:
    proc = run(*args, "--help")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert text.startswith("usage: pg-idempotency")
    for needle in needles:
        assert needle in text


def test_version() -> None:
    from pg_idempotency import SCHEMA_VERSION, __version__

    proc = run("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"pg-idempotency {__version__} (needs schema {SCHEMA_VERSION})"


def test_no_command_is_a_usage_error() -> None:
    proc = run()
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr


def test_sql_prints_the_migrations() -> None:
    proc = run("sql")
    assert proc.returncode == 0, proc.stderr
    # Each file between the pair that keeps the installer's search_path (docs/install.md).
    assert proc.stdout == "".join(SAVE_SEARCH_PATH + p.read_text(encoding="utf-8")
                                  + RESTORE_SEARCH_PATH for p in MIGRATIONS)


def test_migrate_then_up_to_date(empty_db: str) -> None:
    first = run("migrate", "--dsn", empty_db)
    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines() == [f"applied {p.stem}" for p in MIGRATIONS]
    second = run("migrate", env={"DATABASE_URL": empty_db})
    assert second.returncode == 0, second.stderr
    assert second.stdout.startswith("up to date")
    with psycopg.connect(empty_db) as conn:
        (count,) = conn.execute("SELECT count(*) FROM idempotency.migrations").fetchone()
    assert count == len(MIGRATIONS)


def test_sql_output_installs_with_psql(server: PgServer, empty_db: str) -> None:
    script = run("sql").stdout
    server.run_psql(empty_db, script, args=("-X", "-q", "-1", "-v", "ON_ERROR_STOP=1"))
    proc = run("migrate", "--dsn", empty_db)
    assert proc.returncode == 0 and proc.stdout.startswith("up to date"), proc


def test_no_dsn() -> None:
    assert_one_line_error(run("migrate"), "--dsn", "DATABASE_URL")


def test_unreachable_server() -> None:
    dsn = f"postgresql://postgres@127.0.0.1:{closed_port()}/postgres"
    assert_one_line_error(run("migrate", "--dsn", dsn), "cannot connect", "Connection refused")


def test_auth_failure(server: PgServer) -> None:
    """The test servers use trust authentication, so a wrong password is never checked. A role
    that does not exist is refused during authentication all the same (server-side FATAL,
    SQLSTATE 28000 invalid_authorization_specification), which is the path tested here."""
    dsn = server.dsn("postgres", user=f"no_such_role_{uuid.uuid4().hex[:8]}")
    proc = run("migrate", "--dsn", dsn)
    assert_one_line_error(proc, "cannot connect", "role", "does not exist")
    # the password is never echoed
    proc = run("migrate", "--dsn", dsn.replace("@", ":s3cret-pw@"))
    assert_one_line_error(proc, "cannot connect")
    assert "s3cret-pw" not in proc.stderr


def test_database_does_not_exist(server: PgServer) -> None:
    dsn = server.dsn(f"no_such_db_{uuid.uuid4().hex[:8]}")
    assert_one_line_error(run("migrate", "--dsn", dsn), "cannot connect", "does not exist")


@pytest.mark.parametrize("dsn", [
    "nonsense_option=1", "host=127.0.0.1 port=abc", "postgresql://u@127.0.0.1:99999/db",
    "host=127.0.0.1 sslmode=bogus", "host=127.0.0.1 connect_timeout=soon",
    "postgresql://%zz@127.0.0.1/x"])
def test_invalid_dsn_exits_2(dsn: str) -> None:
    proc = run("migrate", "--dsn", dsn)
    assert_one_line_error(proc, "invalid DSN")
    assert proc.returncode == 2, proc.stderr


def test_unreachable_server_exits_1() -> None:
    proc = run("migrate", "--dsn", f"postgresql://x@127.0.0.1:{closed_port()}/x")
    assert_one_line_error(proc, "cannot connect")
    assert proc.returncode == 1


def test_sql_error_during_migrate(server: PgServer, empty_db: str) -> None:
    """A role without CREATE on the database: the migration fails with 42501, rolled back."""
    role = f"idem_weak_{uuid.uuid4().hex[:8]}"
    admin = server.dsn("postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    try:
        proc = run("migrate", "--dsn", server.dsn(empty_db.rsplit("/", 1)[1], user=role))
        assert_one_line_error(proc, "migrate failed", "SQLSTATE 42501", "permission denied")
        with psycopg.connect(empty_db) as conn:
            (schema,) = conn.execute("SELECT to_regnamespace('idempotency')").fetchone()
        assert schema is None
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


@pytest.mark.pg15
def test_wrong_password() -> None:
    """A server of its own with password authentication on TCP (the shared ones trust)."""
    with PgServer(flavour_bindir("pg15"), name="scram") as srv:
        srv.run_psql(srv.dsn(unix_socket=True),
                     "CREATE ROLE app LOGIN PASSWORD 'right-password';")
        (srv.datadir / "pg_hba.conf").write_text(
            "local all all trust\nhost all all 127.0.0.1/32 scram-sha-256\n")
        srv.run_psql(srv.dsn(unix_socket=True), "SELECT pg_reload_conf();")
        dsn = f"postgresql://app:wrong-password@127.0.0.1:{srv.port}/postgres"
        proc = run("migrate", env={"DATABASE_URL": dsn})
        assert_one_line_error(proc, "cannot connect", "password authentication failed")
        assert "wrong-password" not in proc.stderr


def test_schema_missing(empty_db: str, monkeypatch: pytest.MonkeyPatch,
                        capsys: pytest.CaptureFixture[str]) -> None:
    """Commands that use the schema (needs_schema) refuse a database without it in one line.
    (No shipped command needs it yet: a stand-in is registered for the test.)"""
    ran: list[str] = []
    stand_in = cli.Command("probe", help="h", description="d", database=True,
                           needs_schema=True, run=lambda args, conn: ran.append("x") or 0)
    monkeypatch.setattr(cli, "COMMANDS", [*cli.COMMANDS, stand_in])
    assert cli.main(["probe", "--dsn", empty_db]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "idempotency schema is not installed" in err[0], err
    assert "pg-idempotency migrate" in err[0] and ran == []
    assert cli.main(["migrate", "--dsn", empty_db]) == 0
    assert cli.main(["probe", "--dsn", empty_db]) == 0 and ran == ["x"]


def test_maintain_and_status(empty_db: str) -> None:
    """maintain re-creates a partition made ahead that went missing and prints that step;
    status shows the key claimed."""
    assert run("migrate", "--dsn", empty_db).returncode == 0
    last_ahead = ("SELECT partition_name FROM idempotency.partition_status() "
                  "WHERE parent_table = 'keys' AND lower_bound IS NOT NULL "
                  "ORDER BY lower_bound DESC LIMIT 1")
    with psycopg.connect(empty_db, autocommit=True) as conn:
        conn.execute("SELECT idempotency.claim('acct_cli', 'k1', '{}')")
        (victim,) = conn.execute(last_ahead).fetchone()
        conn.execute(sql.SQL("DROP TABLE idempotency.{}").format(sql.Identifier(victim)))
        assert conn.execute(last_ahead).fetchone()[0] != victim
    proc = run("maintain", "--dsn", empty_db)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert victim in proc.stdout and "created" in proc.stdout, proc.stdout
    with psycopg.connect(empty_db, autocommit=True) as conn:
        assert conn.execute(last_ahead).fetchone()[0] == victim

    proc = run("status", "--dsn", empty_db, env={"DATABASE_URL": "ignored://"})
    assert proc.returncode == 0, proc.stderr
    assert "acct_cli" in proc.stdout and "in_progress" in proc.stdout


def test_status_summarises_per_scope_with_a_limit_and_json(empty_db: str) -> None:
    assert run("migrate", "--dsn", empty_db).returncode == 0
    with psycopg.connect(empty_db, autocommit=True) as conn:
        for scope, n in (("big", 5), ("mid", 3), ("small", 1)):
            for i in range(n):
                claimed = idem.claim(conn, scope, f"k{i}", {})
                if i % 2:
                    idem.complete(conn, scope, f"k{i}", claimed.lease_token, 200)
    proc = run("status", "--dsn", empty_db, "--limit", "2")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:6] == ["scope", "keys", "in_progress", "completed", "released",
                                    "tombstone"]
    assert lines[2].split()[:6] == ["big", "5", "3", "2", "0", "0"]
    assert lines[3].split()[:6] == ["mid", "3", "2", "1", "0", "0"]
    assert lines[4] == "... and 1 more scopes with 1 keys (--limit)"
    assert "small" not in proc.stdout

    proc = run("status", "--dsn", empty_db, "--json", "--limit", "1")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["scopes_total"] == 3 and [s["scope"] for s in doc["scopes"]] == ["big"]
    big = doc["scopes"][0]
    assert (big["keys"], big["in_progress"], big["completed"], big["released"],
            big["tombstone"]) == (5, 3, 2, 0, 0)
    assert big["oldest_in_progress_key"] == "k0" and big["expired_leases"] == 0
    assert any(p["note"] == "default" for p in doc["partitions"])
    assert doc["next_drop"] is None or "drop_after" in doc["next_drop"]

    proc = run("status", "--dsn", empty_db, "--limit", "0")
    assert proc.returncode == 2 and "--limit" in proc.stderr and "Traceback" not in proc.stderr


def test_status_counts_add_up_with_released_keys(empty_db: str) -> None:
    """A released key stays a row (state released, from 0.9.0 on): status shows it in a
    column of its own, so that every scope's keys are the sum of its state columns."""
    assert run("migrate", "--dsn", empty_db).returncode == 0
    with psycopg.connect(empty_db, autocommit=True) as conn:
        for i in range(4):
            claimed = idem.claim(conn, "acct_sum", f"k{i}", {})
            if i == 1:
                idem.complete(conn, "acct_sum", f"k{i}", claimed.lease_token, 200)
            if i >= 2:
                idem.release(conn, "acct_sum", f"k{i}", claimed.lease_token)
    proc = run("status", "--dsn", empty_db, "--json")
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(proc.stdout)["scopes"]
    states = {s: row[s] for s in ("in_progress", "completed", "released", "tombstone")}
    assert states == {"in_progress": 1, "completed": 1, "released": 2, "tombstone": 0}
    assert row["keys"] == sum(states.values()) == 4
    proc = run("status", "--dsn", empty_db)
    header, _, line = proc.stdout.splitlines()[:3]
    assert header.split()[:6] == ["scope", "keys", "in_progress", "completed", "released",
                                  "tombstone"]
    assert line.split()[:6] == ["acct_sum", "4", "1", "1", "2", "0"]


def test_status_says_which_schema_the_database_has_and_the_package_needs(empty_db: str) -> None:
    """status names the database's schema version and the one this package needs (they may
    differ from the package's own version: a patch release ships no migration); a database
    behind the package is told to migrate, naming both."""
    from pg_idempotency import SCHEMA_VERSION, __version__
    from pg_idempotency.schema import REQUIRED_MIGRATION, SCHEMA_VERSIONS

    assert run("migrate", "--dsn", empty_db).returncode == 0
    proc = run("status", "--dsn", empty_db)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == (
        f"schema: {SCHEMA_VERSION} (migration {REQUIRED_MIGRATION:04d}); pg-idempotency "
        f"{__version__} needs {SCHEMA_VERSION}")
    proc = run("status", "--dsn", empty_db, "--json")
    assert json.loads(proc.stdout)["schema"] == {
        "installed": SCHEMA_VERSION, "migration": REQUIRED_MIGRATION,
        "required": SCHEMA_VERSION, "package": __version__}
    with psycopg.connect(empty_db, autocommit=True) as conn:
        conn.execute("DELETE FROM idempotency.migrations WHERE version = %s",
                     (REQUIRED_MIGRATION,))
    behind = REQUIRED_MIGRATION - 1
    assert_one_line_error(
        run("status", "--dsn", empty_db),
        f"is at {SCHEMA_VERSIONS[behind]} (migration {behind:04d})",
        f"pg-idempotency {__version__} needs {SCHEMA_VERSION} "
        f"(migration {REQUIRED_MIGRATION:04d}): run 'pg-idempotency migrate' first")


@pytest.mark.parametrize("command", ["status", "maintain", "migrate", "keys list"])
def test_application_role_is_told_to_run_as_the_schema_owner(
        server: PgServer, empty_db: str, command: str) -> None:
    """The least-privilege role of docs/install.md has the engine's functions only: the CLI's
    commands read the schema's tables, and say whose job they are instead of a bare
    'permission denied for table migrations'."""
    assert run("migrate", "--dsn", empty_db).returncode == 0
    with login_roles(server, empty_db, "request") as (role,):
        proc = run(*command.split(), "--dsn", server.dsn(empty_db.rsplit("/", 1)[1], user=role))
        assert_one_line_error(proc, "run this as the schema owner", "SQLSTATE 42501")
        assert proc.returncode == 1


@pytest.mark.parametrize("command", ["maintain", "status"])
def test_maintain_and_status_without_schema(empty_db: str, command: str) -> None:
    assert_one_line_error(run(command, "--dsn", empty_db),
                          "idempotency schema is not installed", "pg-idempotency migrate")


@pytest.mark.parametrize("command", ["maintain", "status"])
def test_maintain_and_status_unreachable(command: str) -> None:
    assert_one_line_error(run(command, "--dsn", f"postgresql://x@127.0.0.1:{closed_port()}/x"),
                          "cannot connect")


@pytest.mark.parametrize("delay", ["-5", "nan", "inf", "soon"])
def test_maintain_refuses_a_bad_retry_delay_in_one_line(delay: str) -> None:
    # Refused by the argument parser (exit 2, usage line) before any connection is made.
    proc = run("maintain", "--dsn", f"postgresql://x@127.0.0.1:{closed_port()}/x",
               f"--retry-delay={delay}")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "--retry-delay" in proc.stderr and delay in proc.stderr
