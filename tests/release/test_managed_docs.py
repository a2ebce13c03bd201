"""docs/managed.md run as written, on a server as a managed service offers it.

The server has pg_tle preloaded (and, on PostgreSQL 15, pg_cron, living in a database of its
own) and none of pg_idempotency's files (harness/pg_tle_server.py); it is the process's, shared
with test_pg_tle.py. The master user is
``admin``: ``LOGIN CREATEROLE CREATEDB``, no superuser. It runs "A database to try it in";
``payments_owner`` runs the pg_tle blocks (the shell ones with ``DATABASE_URL`` set, in a copy of
the checkout's tools/, sql/, migrations/ and schema.py, so that tools/build.py writes nowhere
another test reads), ``pg-idempotency migrate`` and docs/install.md's psql loop. What the page
gives to the provider's administrative role (``CREATE EXTENSION pg_tle`` and ``pg_cron`` and
their grants) runs as the superuser, which stands in for it (on RDS, ``rds_superuser``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from helpers import MIGRATIONS, ROOT, doc_block
from helpers.install import latest_extension_version, reinstall_this_build
from psycopg import sql

from pg_tle_server import CRON_DATABASE, shared_pg_tle_server
from pgharness import WAIT_BOUND, PgServer

DOC = ROOT / "docs" / "managed.md"
VENV_BIN = Path(sys.executable).parent
ADMIN, OWNER, APP, DB = "admin", "payments_owner", "payments_api", "payments"


def block(lang: str, starting: str) -> str:
    """The one fenced block of docs/managed.md in ``lang`` that starts with ``starting``."""
    return doc_block("managed.md", lang, starting)


def install_md_block(starting: str) -> str:
    """The one indented code block of docs/install.md that starts with ``starting``."""
    found = [re.sub(r"^    ", "", m.group(0), flags=re.M) for m in
             re.finditer(r"(?:^    \S.*\n)+", (ROOT / "docs" / "install.md").read_text(), re.M)
             if m.group(0)[4:].startswith(starting)]
    assert len(found) == 1, f"docs/install.md: {len(found)} blocks starting {starting!r}"
    return found[0]


TRY_DB = block("sql", "CREATE ROLE payments_owner")
TLE_PROVIDER = block("sql", "CREATE EXTENSION pg_tle")
TLE_INSTALL = block("sh", "python3 tools/build.py")
TLE_UPGRADE = block("sh", "psql -X -v ON_ERROR_STOP=1 -1 -f build/pg_tle/pg_idempotency.sql")
TLE_REMOVE = block("sql", "DROP EXTENSION pg_idempotency")
CRON_PROVIDER = block("sql", "CREATE EXTENSION pg_cron")
CRON_HERE = block("sql", "SELECT idempotency.schedule_maintenance(")
CRON_GRANT_ELSEWHERE = block("sql", "GRANT EXECUTE ON FUNCTION cron.schedule_in_database(")
CRON_ELSEWHERE = block("sql", "SELECT cron.schedule_in_database(")
PSQL_LOOP = install_md_block("for f in migrations/*.sql; do psql")
# pg_cron's database on PG 15 (Debian has pg_cron for PG 15 only), made by the cron test.
CRON_DB = CRON_DATABASE


@pytest.fixture(scope="module", params=["pg15", "pg18"])
def managed(request: pytest.FixtureRequest) -> PgServer:
    """The process's pg_tle server (shared with test_pg_tle.py, whose roles and databases have
    names of their own), where the master user has run "A database to try it in" once."""
    server = shared_pg_tle_server(request.param)
    made = server.run_psql(server.dsn(), f"SELECT count(*) FROM pg_roles WHERE rolname = "
                           f"'{ADMIN}'", args=("-X", "-At")).stdout.strip()
    if made == "0":
        server.run_psql(server.dsn(), f"CREATE ROLE {ADMIN} LOGIN CREATEROLE CREATEDB;")
        admin = server.dsn(user=ADMIN)
        assert server.run_psql(admin, "SELECT rolsuper FROM pg_roles WHERE rolname = "
                               "current_user", args=("-X", "-At")).stdout.strip() == "f"
        server.run_psql(admin, TRY_DB)
    return server


def rows(dsn: str, query: str) -> list[tuple[object, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(query).fetchall()


def shell(script: str, server: PgServer, cwd: Path, dsn: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env.update(PATH=f"{server.bindir}:{VENV_BIN}:/usr/bin:/bin", DATABASE_URL=dsn, LC_ALL="C")
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=WAIT_BOUND)
    assert done.returncode == 0, f"{script}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def checkout_copy(tmp_path: Path) -> Path:
    """What the pg_tle blocks read from a checkout: tools/, sql/, migrations/, schema.py."""
    copy = tmp_path / "checkout"
    for name in ("tools", "sql", "migrations"):
        shutil.copytree(ROOT / name, copy / name)
    (copy / "python" / "pg_idempotency").mkdir(parents=True)
    shutil.copy2(ROOT / "python" / "pg_idempotency" / "schema.py",
                 copy / "python" / "pg_idempotency" / "schema.py")
    return copy


def round_trip(server: PgServer, key: str) -> None:
    """As the application's role (made by the owner as install.md's "Privileges" says)."""
    with psycopg.connect(server.dsn(DB, user=APP), autocommit=True) as conn:
        claim = ("SELECT outcome, lease_token, response_body "
                 "FROM idempotency.claim('payments', %s, '{}')")
        outcome, token, _ = conn.execute(claim, (key,)).fetchone()
        assert outcome == "claimed"
        conn.execute("SELECT idempotency.complete('payments', %s, %s, 201, '{\"id\": 1}')",
                     (key, token))
        assert conn.execute(claim, (key,)).fetchone() == ("replay", None, {"id": 1})


@pytest.mark.pg_tle
def test_the_try_database_then_pg_tle_install_upgrade_and_removal(
    managed: PgServer, tmp_path: Path
) -> None:
    server = managed
    assert rows(server.dsn(), "SELECT datdba::regrole::text FROM pg_database "
                f"WHERE datname = '{DB}'") == [(OWNER,)]
    owner = server.dsn(DB, user=OWNER)
    server.run_psql(server.dsn(DB), TLE_PROVIDER)
    checkout = checkout_copy(tmp_path)
    shell(TLE_INSTALL, server, checkout, owner)
    assert rows(owner, "SELECT extversion, extowner::regrole::text FROM pg_extension "
                "WHERE extname = 'pg_idempotency'") == [(latest_extension_version(), OWNER)]
    assert rows(owner, "SELECT nspowner::regrole::text FROM pg_namespace "
                "WHERE nspname = 'idempotency'") == [(OWNER,)]
    server.run_psql(owner, "SELECT * FROM idempotency.maintain();"
                    f"CREATE ROLE {APP} LOGIN; SELECT idempotency.grant_usage('{APP}');")
    round_trip(server, "after-install")
    shell(TLE_UPGRADE, server, checkout, owner)
    assert rows(owner, "SELECT extversion FROM pg_extension WHERE extname = 'pg_idempotency'"
                ) == [(latest_extension_version(),)]
    round_trip(server, "after-upgrade")
    server.run_psql(owner, TLE_REMOVE)
    assert rows(owner, "SELECT count(*) FROM pg_namespace WHERE nspname = 'idempotency'"
                ) == [(0,)]
    assert rows(owner, "SELECT count(*) FROM pgtle.available_extensions()") == [(0,)]


@pytest.mark.pg_tle
def test_the_migration_routes_as_an_owner_who_is_no_superuser(managed: PgServer) -> None:
    # Routes 1 (install.md's psql loop) and 2 (pg-idempotency migrate), each into a database
    # of its own that the master user makes for payments_owner as the page's block did.
    server = managed
    admin = server.dsn(user=ADMIN)
    for db in ("payments_psql", "payments_migrate"):
        server.run_psql(admin, f"CREATE DATABASE {db} OWNER {OWNER};")
    shell(PSQL_LOOP, server, ROOT, server.dsn("payments_psql", user=OWNER))
    shell('pg-idempotency migrate --dsn "$DATABASE_URL" > /dev/null', server, ROOT,
          server.dsn("payments_migrate", user=OWNER))
    versions = len(list(MIGRATIONS.glob("*.sql")))
    for db in ("payments_psql", "payments_migrate"):
        dsn = server.dsn(db, user=OWNER)
        assert rows(dsn, "SELECT count(*), max(version) FROM idempotency.migrations") == [
            (versions, versions)]
        assert rows(dsn, "SELECT nspowner::regrole::text FROM pg_namespace "
                    "WHERE nspname = 'idempotency'") == [(OWNER,)]


@pytest.mark.pg_tle
@pytest.mark.pg_cron
@pytest.mark.parametrize("managed", ["pg15"], indirect=True)
def test_pg_cron_needs_the_providers_grants_then_schedules_as_the_owner(
    managed: PgServer
) -> None:
    # The schema in pg_cron's database, installed by the owner; each call of the page refused
    # until the provider's role has granted what the page says, then scheduled.
    server = managed
    server.run_psql(server.dsn(user=ADMIN), f"CREATE DATABASE {CRON_DB} OWNER {OWNER};")
    owner = server.dsn(CRON_DB, user=OWNER)
    shell('pg-idempotency migrate --dsn "$DATABASE_URL" > /dev/null', server, ROOT, owner)
    create, grant = (line for line in CRON_PROVIDER.splitlines() if line.strip())
    superuser = server.dsn(CRON_DB)
    server.run_psql(superuser, create)
    job = ("SELECT jobname, schedule, command, database, username FROM cron.job")
    for call, grants, refusal, database in (
            (CRON_HERE, grant, "permission denied for schema cron", CRON_DB),
            (CRON_ELSEWHERE, CRON_GRANT_ELSEWHERE,
             "permission denied for function schedule_in_database", DB)):
        refused = server.run_psql(owner, call, check=False)
        assert refused.returncode != 0 and refusal in refused.stderr, refused.stderr
        server.run_psql(superuser, grants)
        server.run_psql(owner, call)
        assert rows(superuser, job) == [("pg_idempotency_maintain", "*/10 * * * *",
                                         "SELECT * FROM idempotency.maintain()", database,
                                         OWNER)]
        # The two cases are alternatives (pg_cron 1.4 keeps a job's database when the same
        # name is scheduled again), so the first job goes before the second is made.
        server.run_psql(owner, "SELECT cron.unschedule('pg_idempotency_maintain');")


def test_create_extension_from_the_files_needs_a_superuser(
    server: PgServer, empty_db: str
) -> None:
    # Route 3, with this build's files in the server's extension directory: a CREATEROLE
    # CREATEDB role that is no superuser is refused, as the page says.
    reinstall_this_build(server)
    role = f"files_owner_{os.getpid()}"
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN CREATEROLE CREATEDB")
                     .format(sql.Identifier(role)))
    try:
        dbname = psycopg.conninfo.conninfo_to_dict(empty_db)["dbname"]
        with psycopg.connect(server.dsn(str(dbname), user=role), autocommit=True) as conn:
            with pytest.raises(psycopg.errors.InsufficientPrivilege) as refused:
                conn.execute("CREATE EXTENSION pg_idempotency")
        assert str(refused.value.diag.message_primary) == (
            'permission denied to create extension "pg_idempotency"')
        assert refused.value.diag.message_hint == "Must be superuser to create this extension."
    finally:
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
