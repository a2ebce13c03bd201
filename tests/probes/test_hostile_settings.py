"""Results that do not depend on the caller's session settings (migration 0004).

- maintain() read partition bounds back as text in the session's DateStyle and TimeZone.
  Under DateStyle 'SQL, DMY' and TimeZone Europe/Dublin in summer, PostgreSQL prints the zone
  as "IST", which reads back as Israel's +02: every bound came back an hour early, and a run
  dropped a partition holding a key 15 minutes before its 24-hour retention ended.
- The migrations ran under the installer's search_path, so CHECK constraints bound their
  operators to whatever schema came first.
"""

from __future__ import annotations

import difflib
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from helpers.install import INSTALL_ARGS, MIGRATIONS, normalize_dump, pg_dump, scratch_db
from helpers.probes import HOSTILE_SETTINGS, apply
from psycopg.types.json import Jsonb

from pgharness import PgServer

ISO = {"DateStyle": "ISO, YMD", "TimeZone": "UTC", "IntervalStyle": "postgres",
       "extra_float_digits": "1"}
# A summer day, so Europe/Dublin is on IST (+01).
DAY = datetime(2026, 7, 1, tzinfo=timezone.utc)


def connect(db: str) -> psycopg.Connection[Any]:
    """Results in binary: psycopg cannot parse timestamps printed in non-ISO DateStyles."""
    conn = psycopg.connect(db, autocommit=True)
    conn.cursor_factory = _BinaryCursor
    return conn


class _BinaryCursor(psycopg.Cursor[Any]):
    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        kwargs.setdefault("binary", True)
        return super().execute(query, params, **kwargs)


def partitions(conn: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    return conn.execute("SELECT * FROM idempotency._partitions('keys')").fetchall()


def test_maintain_keeps_a_key_inside_its_retention_under_dublin_summer_settings(db: str
                                                                                 ) -> None:
    with connect(db) as conn:
        apply(conn, HOSTILE_SETTINGS[0])
        # The hazard is real on PostgreSQL 15: the text round trip moves a summer instant.
        # (PostgreSQL 18 reads an abbreviation of the session's own zone first.)
        moved = conn.execute("SELECT %s::timestamptz::text::timestamptz <> %s", (DAY, DAY)
                             ).fetchone()[0]
        assert moved or conn.info.server_version >= 180000, \
            "expected the IST abbreviation to read back as another offset"

        for parent in ("keys", "inbox"):
            conn.execute("SELECT idempotency._create_partition(%s, %s, %s)",
                         (parent, DAY, DAY + timedelta(days=1)))
        created = DAY + timedelta(hours=23, minutes=45)
        token = conn.execute(
            "SELECT lease_token FROM idempotency.claim('tz', 'late-key', %s, "
            "reference_time => %s)", (Jsonb({"a": 1}), created)).fetchone()[0]
        conn.execute("SELECT idempotency.complete('tz', 'late-key', %s, 200, '{}', "
                     "reference_time => %s)", (token, created + timedelta(seconds=1)))

        # The bounds read under hostile settings equal the real ones.
        bounds = conn.execute(
            "SELECT lower_bound, upper_bound FROM idempotency._partitions('keys') "
            "WHERE partition_name = 'keys_p20260701'").fetchone()
        assert bounds == (DAY, DAY + timedelta(days=1))

        # 15 minutes before the key's 24-hour retention ends.
        reference = created + timedelta(hours=24) - timedelta(minutes=15)
        report = conn.execute(
            "SELECT action, partition_name FROM idempotency.maintain(%s)", (reference,)
        ).fetchall()
        assert ("dropped", "keys_p20260701") not in report, report
        assert conn.execute("SELECT count(*) FROM idempotency.keys WHERE key = 'late-key'"
                            ).fetchone()[0] == 1

        # Once the retention has really ended, the partition goes (beside a newer key:
        # maintain() never drops the newest interval holding keys).
        conn.execute("SELECT idempotency.claim('tz', 'newer-key', '{}')")
        report = conn.execute(
            "SELECT action, partition_name FROM idempotency.maintain(%s)",
            (DAY + timedelta(days=2, minutes=1),)).fetchall()
        assert ("dropped", "keys_p20260701") in report, report
        assert conn.execute("SELECT count(*) FROM idempotency.keys WHERE key = 'late-key'"
                            ).fetchone()[0] == 0


def observe(conn: psycopg.Connection[Any]) -> tuple[Any, ...]:
    """What the status and partition functions say, to compare across session settings."""
    return (partitions(conn),
            conn.execute("SELECT * FROM idempotency.partition_status() ORDER BY 1, 2").fetchall(),
            conn.execute("SELECT * FROM idempotency.key_status()").fetchall(),
            conn.execute("SELECT idempotency.canonical_json('{\"n\": 1.50, \"f\": 1e3}')"
                         ).fetchone())


@pytest.mark.parametrize("settings", HOSTILE_SETTINGS, ids=lambda s: s["TimeZone"])
def test_partition_bounds_and_status_equal_iso_utc(db: str, settings: dict[str, str]) -> None:
    with connect(db) as conn:
        apply(conn, settings)
        # A partition made under hostile settings has the bounds asked for.
        assert conn.execute("SELECT idempotency._create_partition('keys', %s, %s)",
                            (DAY, DAY + timedelta(days=1))).fetchone()[0] is True
        conn.execute("SELECT idempotency.claim('st', 'k', '{\"n\": 1.50}', "
                     "reference_time => %s)", (DAY + timedelta(hours=1),))
        hostile = observe(conn)
        apply(conn, ISO)
        iso = observe(conn)
    assert hostile == iso
    assert (DAY, DAY + timedelta(days=1)) in [(p[1], p[2]) for p in iso[0]]


EVIL_OPERATORS = r"""
CREATE SCHEMA evil;
CREATE FUNCTION evil.always(interval, interval) RETURNS boolean LANGUAGE sql RETURN true;
CREATE OPERATOR evil.>= (LEFTARG = interval, RIGHTARG = interval, FUNCTION = evil.always);
CREATE OPERATOR evil.<= (LEFTARG = interval, RIGHTARG = interval, FUNCTION = evil.always);
CREATE OPERATOR evil.> (LEFTARG = interval, RIGHTARG = interval, FUNCTION = evil.always);
GRANT USAGE ON SCHEMA evil TO public;
"""


def test_migrations_under_a_hostile_search_path_give_the_clean_schema(server: PgServer
                                                                      ) -> None:
    dumps = {}
    for label, prefix in (("clean", ""), ("hostile", "SET search_path = evil, pg_catalog;\n")):
        with scratch_db(server, f"sp_{label}") as dsn:
            server.run_psql(dsn, EVIL_OPERATORS)
            for migration in MIGRATIONS:
                server.run_psql(dsn, prefix + migration.read_text(), args=INSTALL_ARGS)
            dumps[label] = normalize_dump(pg_dump(
                server, dsn, "--schema=idempotency", "--schema-only"))
    assert "evil" not in dumps["hostile"]
    diff = "\n".join(difflib.unified_diff(dumps["clean"].splitlines(),
                                          dumps["hostile"].splitlines(), lineterm="", n=2))
    assert not diff, f"an install under a hostile search_path differs:\n{diff[:4000]}"
