"""The Python package under session settings nobody chose for it: DateStyle, IntervalStyle and
TimeZone set as connection options, for the role (``ALTER ROLE ... SET``) or for the database
(``ALTER DATABASE ... SET``), as a DBA sets them.

psycopg's loaders parse timestamptz only in DateStyle ISO and interval only in IntervalStyle
postgres; before the package read them as epoch seconds (queries._seconds), every call that
returns a time failed with NotImplementedError under these. Each value is compared with what
the server stored, read with psycopg's own loaders on a connection in ISO and UTC: the values
the package returned before, where it worked.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from helpers import login_roles
from helpers.api import _enter, call, run
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import dict_row

import pg_idempotency as idem
from pg_idempotency import SCHEMA_VERSION, aio, maintenance
from pg_idempotency.core import AbandonedKey

pytestmark = pytest.mark.anyio

SETTINGS = [
    {"DateStyle": "SQL, DMY", "IntervalStyle": "sql_standard", "TimeZone": "Pacific/Chatham"},
    {"DateStyle": "German", "IntervalStyle": "iso_8601", "TimeZone": "America/St_Johns"},
    {"DateStyle": "Postgres, MDY", "IntervalStyle": "postgres_verbose",
     "TimeZone": "Asia/Kathmandu"},
]
SETTINGS_IDS = ["sql-dmy", "german", "postgres-mdy"]
ISO_UTC = {"DateStyle": "ISO, YMD", "IntervalStyle": "postgres", "TimeZone": "UTC"}
ZERO = timedelta(0)

# The test clock: an aware time in neither UTC nor any of the session zones, and a lease with
# microseconds, so that an offset or a rounding anywhere shows.
T0 = datetime(2026, 3, 1, 23, 30, 0, 123456, tzinfo=timezone(timedelta(hours=5, minutes=45)))
LEASE = timedelta(seconds=30, microseconds=7)


def options(settings: dict[str, str]) -> str:
    return " ".join(f"-c {name}={value.replace(' ', '')}" for name, value in settings.items())


def plain(db: str) -> psycopg.Connection[Any]:
    """A connection in ISO and UTC whatever the role's and the database's settings."""
    return psycopg.connect(db, autocommit=True, options=options(ISO_UTC))


def stored(db: str, key: str) -> dict[str, Any]:
    """The key's times as the server stored them, read with psycopg's loaders."""
    with plain(db) as conn, conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute("SELECT created_at, lease_expires_at, completed_at, attempts "
                          "FROM idempotency.keys WHERE key = %s", (key,)).fetchone()
    assert row is not None, key
    return row


def settle(db: str, settings: dict[str, str], via: str, role: str = "postgres") -> str:
    """Put ``settings`` where ``via`` says; the conninfo to connect as ``role`` with them."""
    if via == "options":
        return make_conninfo(db, user=role, options=options(settings))
    dbname = conninfo_to_dict(db)["dbname"]
    if via == "database":
        target = sql.SQL("DATABASE {}").format(sql.Identifier(dbname))
    elif role == "postgres":  # the owner's settings in this scratch database only
        target = sql.SQL("ROLE postgres IN DATABASE {}").format(sql.Identifier(dbname))
    else:
        target = sql.SQL("ROLE {}").format(sql.Identifier(role))
    with plain(db) as conn:
        for name, value in settings.items():
            conn.execute(sql.SQL("ALTER {} SET {} = {}").format(
                target, sql.Identifier(name.lower()), sql.Literal(value)))
    return make_conninfo(db, user=role)


async def assert_settings(conn: Any, settings: dict[str, str]) -> None:
    """The session really runs with ``settings`` (German shows as "German, DMY")."""
    for name, value in settings.items():
        cur = await call(conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(name.lower()))))
        shown = (await call(cur.fetchone()))[0]
        assert shown == value or shown.startswith(f"{value},"), (name, shown)


def utc(value: datetime) -> datetime:
    assert value.utcoffset() == ZERO, value
    return value


@pytest.fixture(params=["sync", "async", "sync-client-binding"])
def kind(request: pytest.FixtureRequest) -> str:
    """psycopg's default cursor (parameters in binary), the async one, and ClientCursor
    (parameters as text literals, as Django sends them)."""
    return request.param


@asynccontextmanager
async def connect(conninfo: str, kind: str) -> AsyncIterator[tuple[Any, Any]]:
    """(api module, autocommit connection) of ``kind``."""
    if kind == "async":
        async with await psycopg.AsyncConnection.connect(conninfo, autocommit=True) as conn:
            yield aio, conn
        return
    factory = psycopg.ClientCursor if kind == "sync-client-binding" else psycopg.Cursor
    with psycopg.connect(conninfo, autocommit=True, cursor_factory=factory) as conn:
        yield idem, conn


# -- the lifecycle on the owner's test clock: every value exact --------------------------------

@pytest.mark.parametrize("via", ["options", "role", "database"])
@pytest.mark.parametrize("settings", SETTINGS, ids=SETTINGS_IDS)
async def test_lifecycle_on_the_test_clock(db: str, settings: dict[str, str], via: str,
                                           kind: str) -> None:
    async with connect(settle(db, settings, via), kind) as (api, conn):
        await assert_settings(conn, settings)
        at = lambda seconds: T0 + timedelta(seconds=seconds)  # noqa: E731

        claimed = await call(api.claim(conn, "acct", "k1", {"a": 1}, lease=LEASE,
                                       reference_time=T0))
        assert claimed.outcome is idem.Outcome.CLAIMED
        # the aware reference_time is honoured: the same instant, whatever the session's zone
        assert utc(claimed.created_at) == T0 and utc(claimed.lease_expires_at) == T0 + LEASE
        assert stored(db, "k1")["lease_expires_at"] == T0 + LEASE
        token = claimed.lease_token

        busy = await call(api.claim(conn, "acct", "k1", {"a": 1}, reference_time=at(4.5)))
        assert busy.outcome is idem.Outcome.IN_PROGRESS
        assert busy.retry_after == timedelta(seconds=25, microseconds=500007)
        assert busy.created_at == T0

        # a lease of a day goes in as a day; a retry_after with a day part comes back whole
        beat = await call(api.heartbeat(conn, "acct", "k1", token, lease=timedelta(days=1),
                                        reference_time=at(5)))
        assert utc(beat) == at(5) + timedelta(days=1) == stored(db, "k1")["lease_expires_at"]
        busy = await call(api.claim(conn, "acct", "k1", {"a": 1}, reference_time=at(2)))
        assert busy.retry_after == timedelta(days=1, seconds=3)

        extended = await call(api.checkpoint(conn, "acct", "k1", token, "charged",
                                             extend=timedelta(hours=24), reference_time=at(6.25)))
        assert utc(extended) == at(6.25) + timedelta(days=1)
        assert extended == stored(db, "k1")["lease_expires_at"]

        done = await call(api.complete(conn, "acct", "k1", token, 201, {"id": 1},
                                       reference_time=at(7)))
        assert utc(done) == at(7) == stored(db, "k1")["completed_at"]
        replay = await call(api.claim(conn, "acct", "k1", {"a": 1}, reference_time=at(8)))
        assert replay.outcome is idem.Outcome.REPLAY and replay.created_at == T0
        assert utc(replay.response.completed_at) == done
        assert (replay.response.status, replay.response.json()) == (201, {"id": 1})

        # an abandoned key: listed with its times, taken over, handed to a worker (accept)
        await call(api.claim(conn, "acct", "k2", {"a": 2}, lease=10, reference_time=T0))
        abandoned = await call(api.list_abandoned(conn, scope="acct", reference_time=at(11)))
        assert abandoned == [AbandonedKey("acct", "k2", at(10), None, 1, T0)]
        assert all(utc(a.lease_expires_at) and utc(a.created_at) for a in abandoned)
        taken = await call(api.takeover(conn, "acct", "k2", lease=LEASE, reference_time=at(11)))
        assert taken.outcome is idem.Outcome.RESUMED and taken.attempts == 2
        assert utc(taken.lease_expires_at) == at(11) + LEASE and taken.created_at == T0
        handed = await call(api.accept(conn, "acct", "k2", taken.lease_token, 202, {"job": 1},
                                       lease=timedelta(minutes=5), reference_time=at(12)))
        assert utc(handed) == at(12) + timedelta(minutes=5) == stored(db, "k2")["lease_expires_at"]
        accepted = await call(api.claim(conn, "acct", "k2", {"a": 2}, reference_time=at(13)))
        assert accepted.outcome is idem.Outcome.ACCEPTED
        assert accepted.response.completed_at is None and accepted.response.status == 202

        # the guided flow on the same clock
        async with _enter(api.operation(conn, "acct", "k3", {"a": 3}, lease=LEASE,
                                        reference_time=T0)) as op:
            assert op.claim_result.lease_expires_at == T0 + LEASE
            assert utc(await call(op.checkpoint("step", extend=60))) == at(60)
            response = await call(op.complete(200, {"ok": True}))
        assert utc(response.completed_at) == T0 == stored(db, "k3")["completed_at"]
        async with _enter(api.operation(conn, "acct", "k3", {"a": 3},
                                        reference_time=at(1))) as op:
            assert op.replay.completed_at == T0 and op.replay.json() == {"ok": True}
        await assert_settings(conn, settings)


# -- login roles on the server's clock: what an application runs -------------------------------

@pytest.mark.parametrize("via", ["options", "role"])
@pytest.mark.parametrize("settings", SETTINGS, ids=SETTINGS_IDS)
async def test_login_roles_on_the_server_clock(server: Any, db: str, settings: dict[str, str],
                                               via: str, kind: str) -> None:
    with login_roles(server, db, "request", "completer") as (request, completer):
        async with connect(settle(db, settings, via, request), kind) as (api, conn), \
                connect(settle(db, settings, via, completer), kind) as (_, worker):
            await assert_settings(conn, settings)
            await assert_settings(worker, settings)
            before = datetime.now(timezone.utc)
            claimed = await call(api.claim(conn, "acct", "k1", {"a": 1}, lease=LEASE))
            row = stored(db, "k1")
            assert utc(claimed.created_at) == row["created_at"]
            assert utc(claimed.lease_expires_at) == row["lease_expires_at"]
            # a lease of 30 s is 30 s from the claim, to the microsecond
            assert claimed.lease_expires_at - claimed.created_at == LEASE
            assert abs(claimed.created_at - before) < timedelta(minutes=1)
            token = claimed.lease_token

            busy = await call(api.claim(conn, "acct", "k1", {"a": 1}))
            assert busy.outcome is idem.Outcome.IN_PROGRESS and busy.created_at == row["created_at"]
            # retry_after is the lease left at the server's time of that claim
            assert ZERO < busy.retry_after < LEASE
            server_time = row["lease_expires_at"] - busy.retry_after
            assert row["created_at"] < server_time < datetime.now(timezone.utc) + timedelta(
                minutes=1)

            beat = await call(api.heartbeat(conn, "acct", "k1", token, lease=timedelta(hours=2)))
            assert utc(beat) == stored(db, "k1")["lease_expires_at"]
            assert timedelta(hours=2) < beat - claimed.created_at < timedelta(hours=2, minutes=1)
            extended = await call(api.checkpoint(conn, "acct", "k1", token, "charged",
                                                 extend=timedelta(hours=3)))
            assert utc(extended) == stored(db, "k1")["lease_expires_at"]
            assert timedelta(hours=3) < extended - claimed.created_at < timedelta(hours=3,
                                                                                    minutes=1)
            done = await call(api.complete(conn, "acct", "k1", token, 201, {"id": 1}))
            assert utc(done) == stored(db, "k1")["completed_at"]
            replay = await call(api.claim(conn, "acct", "k1", {"a": 1}))
            assert replay.outcome is idem.Outcome.REPLAY
            assert replay.response.completed_at == done and replay.response.json() == {"id": 1}
            assert replay.created_at == claimed.created_at

            async with _enter(api.operation(conn, "acct", "k3", {"a": 3})) as op:
                assert op.claim_result.lease_expires_at == stored(db, "k3")["lease_expires_at"]
                extended = await call(op.checkpoint("step", extend=timedelta(minutes=10)))
                assert extended == stored(db, "k3")["lease_expires_at"]
                response = await call(op.complete(200, {"ok": True}))
            assert utc(response.completed_at) == stored(db, "k3")["completed_at"]
            async with _enter(api.operation(conn, "acct", "k3", {"a": 3})) as op:
                assert op.replay.completed_at == response.completed_at

            assert await call(api.inbox_accept(conn, "orders", "m1")) is True
            assert await call(api.inbox_accept(conn, "orders", "m1")) is False

            # a crashed request's key: the completer lists it and takes it over
            await call(api.claim(conn, "acct", "k2", {"a": 2}, lease=timedelta(milliseconds=50)))
            time.sleep(0.1)
            row = stored(db, "k2")
            abandoned = await call(api.list_abandoned(worker, scope="acct"))
            assert abandoned == [AbandonedKey("acct", "k2", row["lease_expires_at"], None, 1,
                                              row["created_at"])]
            taken = await call(api.takeover(worker, "acct", "k2", lease=LEASE))
            assert taken.outcome is idem.Outcome.RESUMED and taken.created_at == row["created_at"]
            assert utc(taken.lease_expires_at) == stored(db, "k2")["lease_expires_at"]
            done = await call(api.complete(worker, "acct", "k2", taken.lease_token, 200))
            assert utc(done) == stored(db, "k2")["completed_at"]
            assert taken.lease_expires_at - LEASE < done  # taken over, then completed
            busy = await call(api.claim(conn, "acct", "k2", {"a": 2}))
            assert busy.outcome is idem.Outcome.REPLAY and busy.response.completed_at == done


# -- maintenance, status and the CLI -----------------------------------------------------------

def native_status(db: str, reference_time: datetime
                  ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """key_status() and partition_status() read with psycopg's loaders in ISO and UTC."""
    with plain(db) as conn, conn.cursor(row_factory=dict_row) as cur:
        keys = cur.execute("SELECT * FROM idempotency.key_status(%s)",
                           (reference_time,)).fetchall()
        parts = cur.execute("SELECT * FROM idempotency.partition_status(%s)",
                            (reference_time,)).fetchall()
    return keys, parts


LAST_AHEAD = ("SELECT partition_name, lower_bound, upper_bound FROM idempotency.partition_status() "
              "WHERE parent_table = 'keys' AND lower_bound IS NOT NULL "
              "ORDER BY lower_bound DESC LIMIT 1")


def lose_a_partition(db: str) -> tuple[str, datetime, datetime]:
    """Drop the last partition made ahead, so that maintain() creates it again."""
    with plain(db) as conn:
        name, lower, upper = conn.execute(LAST_AHEAD).fetchone()
        conn.execute(sql.SQL("DROP TABLE idempotency.{}").format(sql.Identifier(name)))
    return name, lower, upper


def keys_for_status(db: str) -> dict[str, Any]:
    """A key in progress and a completed one, on the server's clock (maintain() drops what is
    older than the retention); the open key's stored times."""
    with plain(db) as conn:
        idem.claim(conn, "st", "open", {}, lease=LEASE)
        claimed = idem.claim(conn, "st", "done", {})
        idem.complete(conn, "st", "done", claimed.lease_token, 200)
    return stored(db, "open")


@pytest.mark.parametrize("via", ["options", "role", "database"])
@pytest.mark.parametrize("settings", SETTINGS, ids=SETTINGS_IDS)
def test_maintenance_and_status(db: str, settings: dict[str, str], via: str) -> None:
    key = keys_for_status(db)
    later = key["created_at"] + timedelta(minutes=1)  # the open key's lease has expired
    name, lower, upper = lose_a_partition(db)
    with psycopg.connect(settle(db, settings, via), autocommit=True) as conn:
        steps = maintenance.run_maintenance(conn, attempts=1)
        created = [s for s in steps if s.action == "created" and s.partition_name == name]
        assert [(utc(s.lower_bound), utc(s.upper_bound)) for s in created] == [(lower, upper)]
        assert name in maintenance.format_report(steps)

        status = maintenance.fetch_status(conn, reference_time=later)
    assert (status.keys, status.partitions) == native_status(db, later)
    (open_,) = [k for k in status.keys if k["state"] == "in_progress"]
    assert utc(open_["oldest_created_at"]) == key["created_at"]
    assert utc(open_["oldest_expired_lease"]) == key["lease_expires_at"]
    assert open_["expired_leases"] == 1
    assert all(utc(p[c]) for p in status.partitions for c in ("lower_bound", "upper_bound",
                                                              "drop_after") if p[c])
    summary = maintenance.status_json(status)
    (st,) = [s for s in summary["scopes"] if s["scope"] == "st"]
    assert datetime.fromisoformat(st["oldest_in_progress"]) == key["created_at"]
    assert datetime.fromisoformat(st["oldest_expired_lease"]) == key["lease_expires_at"]
    text = maintenance.format_status(status)
    assert key["created_at"].astimezone(timezone.utc).isoformat(sep=" ", timespec="seconds") \
        in text


@pytest.mark.parametrize("settings", SETTINGS, ids=SETTINGS_IDS)
def test_cli_under_database_settings(db: str, settings: dict[str, str]) -> None:
    """``pg-idempotency maintain`` and ``status --json`` where the DBA set the styles for the
    database: the same JSON as in ISO and UTC."""
    key = keys_for_status(db)
    name, lower, upper = lose_a_partition(db)
    hostile = settle(db, settings, "database")
    proc = run("maintain", "--dsn", hostile)
    assert proc.returncode == 0, proc.stderr
    assert name in proc.stdout and "created" in proc.stdout, proc.stdout
    with plain(db) as conn:
        assert conn.execute(LAST_AHEAD).fetchone() == (name, lower, upper)

    proc = run("status", "--json", "--dsn", hostile)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    with plain(db) as conn:
        expected = maintenance.status_json(maintenance.fetch_status(conn))
    assert doc.pop("schema")["installed"] == SCHEMA_VERSION
    assert doc == json.loads(json.dumps(expected))
    (st,) = [s for s in doc["scopes"] if s["scope"] == "st"]
    assert datetime.fromisoformat(st["oldest_in_progress"]) == key["created_at"]
    with plain(db) as conn:
        drops = conn.execute("SELECT partition_name, drop_after FROM idempotency."
                             "partition_status() WHERE drop_after IS NOT NULL").fetchall()
    assert sorted((p["partition_name"], datetime.fromisoformat(p["drop_after"]))
                  for p in doc["partitions"] if p["drop_after"]) == sorted(drops)
