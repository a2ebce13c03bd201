"""The engine keeps working when pg_partman (Debian's postgresql-15-partman, 4.7) manages the
partitions of idempotency.keys and idempotency.inbox instead of maintain().

The hand-over is the one docs/maintenance.md gives an operator, run on a live install:
manage_partitions off, the engine's partitions renamed to pg_partman's names, the engine's
default partition swapped for pg_partman's. Then claims, completes, replays and inbox
deliveries work in pg_partman's partitions, pg_partman's run_maintenance() makes partitions
ahead and drops expired ones, and maintain() leaves them alone.

On both servers: the embedded PostgreSQL 18 gets Debian's pg_partman SQL files (an extension
without C functions) from `make setup`, as it gets pgTAP.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import psycopg
import pytest
from psycopg.types.json import Jsonb

from pgharness import PgServer

# Needs (tests/README.md): pg_partman in each server's extension directory.
pytestmark = pytest.mark.partman

ROOT = Path(__file__).resolve().parents[2]
HAND_OVER = (ROOT / "docs" / "maintenance.md")


def hand_over_sql() -> str:
    """The SQL block of docs/maintenance.md between the partman-hand-over markers."""
    text = HAND_OVER.read_text()
    start = text.index("<!-- partman-hand-over -->")
    block = text[start:].split("```sql", 1)[1].split("```", 1)[0]
    assert "create_parent" in block
    return block


@pytest.mark.parametrize("server", ["pg15", "pg18"], indirect=True)
def test_pg_partman_manages_the_partitions(server: PgServer, db: str) -> None:
    with psycopg.connect(db, autocommit=True, options="-c timezone=UTC") as conn:
        # A live install: one key completed before the hand-over, one message accepted.
        token = conn.execute("SELECT lease_token FROM idempotency.claim('pm', 'before', '{}')"
                             ).fetchone()[0]
        conn.execute("SELECT idempotency.complete('pm', 'before', %s, 200, '{\"n\": 1}')",
                     (token,))
        assert conn.execute("SELECT idempotency.inbox_accept('pm', 'm1')").fetchone()[0]

        conn.execute("CREATE SCHEMA partman")
        conn.execute("CREATE EXTENSION pg_partman SCHEMA partman")
        server.run_psql(db, "SET timezone = 'UTC';\n" + hand_over_sql())

        cfg = conn.execute("SELECT parent_table, control, partition_interval "
                           "FROM partman.part_config ORDER BY 1").fetchall()
        assert cfg == [("idempotency.inbox", "received_at", "1 day"),
                       ("idempotency.keys", "created_at", "1 day")]
        parts = [r[0] for r in conn.execute(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = 'idempotency.keys'::regclass ORDER BY 1")]
        assert "keys_default" in parts and all(
            p == "keys_default" or len(p) == len("keys_p2026_12_02") for p in parts), parts

        # Keys from before the hand-over are still found; new ones work as before.
        assert conn.execute("SELECT outcome, response_body FROM idempotency.claim("
                            "'pm', 'before', '{}')").fetchone() == ("replay", {"n": 1})
        assert not conn.execute("SELECT idempotency.inbox_accept('pm', 'm1')").fetchone()[0]
        outcome, token = conn.execute("SELECT outcome, lease_token FROM idempotency.claim("
                                      "'pm', 'after', '{}')").fetchone()
        assert outcome == "claimed"
        conn.execute("SELECT idempotency.complete('pm', 'after', %s, 201, '{}')", (token,))
        home = conn.execute("SELECT tableoid::regclass::text FROM idempotency.keys "
                            "WHERE key = 'after'").fetchone()[0]
        today = conn.execute("SELECT to_char(now(), 'YYYY_MM_DD')").fetchone()[0]
        assert home == f"idempotency.keys_p{today}", home

        # An old partition made by pg_partman, with a key in it, then its retention.
        old = conn.execute("SELECT date_trunc('day', now()) - interval '5 days'").fetchone()[0]
        conn.execute("SELECT partman.create_partition_time('idempotency.keys', ARRAY[%s])",
                     (old,))
        t = conn.execute("SELECT lease_token FROM idempotency.claim('pm', 'old', %s, "
                         "reference_time => %s)", (Jsonb({}), old + timedelta(hours=1))
                         ).fetchone()[0]
        conn.execute("SELECT idempotency.complete('pm', 'old', %s, 200, '{}', "
                     "reference_time => %s)", (t, old + timedelta(hours=2)))
        old_name = conn.execute("SELECT tableoid::regclass::text FROM idempotency.keys "
                                "WHERE key = 'old'").fetchone()[0]
        assert old_name == f"idempotency.keys_p{old:%Y_%m_%d}"

        # maintain() leaves pg_partman's partitions alone.
        steps = conn.execute("SELECT action, parent_table FROM idempotency.maintain() "
                             "WHERE parent_table <> 'tombstones'").fetchall()
        assert sorted(steps) == [("skipped", "inbox"), ("skipped", "keys")], steps
        assert conn.execute("SELECT to_regclass(%s)", (old_name,)).fetchone()[0] is not None

        # pg_partman's maintenance: its retention drops the old partition, premake goes on.
        conn.execute("UPDATE partman.part_config SET retention = '2 days', "
                     "retention_keep_table = false WHERE parent_table = 'idempotency.keys'")
        conn.execute("SELECT partman.run_maintenance('idempotency.keys', p_jobmon => false)")
        assert conn.execute("SELECT to_regclass(%s)", (old_name,)).fetchone()[0] is None
        ahead = conn.execute("SELECT to_char(now() + interval '3 days', 'YYYY_MM_DD')"
                             ).fetchone()[0]
        assert conn.execute("SELECT to_regclass(%s)", (f"idempotency.keys_p{ahead}",)
                            ).fetchone()[0] is not None
        assert conn.execute("SELECT outcome FROM idempotency.claim('pm', 'old', '{}')"
                            ).fetchone()[0] == "claimed", "dropped by pg_partman: a new request"
        assert conn.execute("SELECT outcome FROM idempotency.claim('pm', 'after', '{}')"
                            ).fetchone()[0] == "replay"
        # The engine's own helper does not fight pg_partman: overlapping ranges are skipped.
        assert conn.execute("SELECT idempotency._premake()").fetchone()[0] == 0
