"""Keys claimed before 0.12.0 still match their retries after it (issue 49, item 1).

0.12.0 writes a number outside 1e-7 <= |n| < 1e21 with an exponent (docs/fingerprint.md), so a
request holding one has another canonical text and another fingerprint than under 0.11.0. Here
migrations 0001-0011 are applied, keys are claimed (and one completed) through 0.11.0's SQL as
the request role, 0012 is applied, and the retries go through the new SQL and the new package:
the same request gets in_progress or replay, never mismatch; another request, mismatch; a
request whose old text is over the size limit (which 0.12.0 will not build), mismatch, never a
replay. The fingerprint of every vector without such a number is byte-identical before and
after.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers import MIGRATION_PSQL_ARGS, MIGRATIONS, login_roles

from pg_idempotency import api
from pg_idempotency.core import Outcome
from pg_idempotency.errors import KeyMismatch
from pg_idempotency.fingerprint import LegacyFingerprint, fingerprint, loads
from pgharness import PgServer

ROOT = Path(__file__).resolve().parent.parent.parent
VECTORS = json.loads((ROOT / "tests" / "vectors" / "fingerprint.json").read_text())

OPEN = '{"amount": 1e30, "rate": 1.5e-9, "items": [1, 2.50, {"x": -123e-30}]}'
DONE = '{"n": 123456789012345678901234567890, "note": "big"}'
# 0.11.0's text of five 1e131071 is 655,366 bytes, within the 1 MiB limit: recognised; of
# ten, 1,310,731 bytes: over it, so 0.12.0 does not build it and the retry is a mismatch.
FITS = "[" + ",".join(["1e131071"] * 5) + "]"
OVER = "[" + ",".join(["1e131071"] * 10) + "]"


def outcome(app: psycopg.Connection[Any], key: str, request: str, strict: bool = False) -> str:
    return app.execute("SELECT outcome FROM idempotency.claim('s', %s, %s::jsonb, "
                       "strict => %s)", (key, request, strict)).fetchone()[0]


def test_keys_claimed_under_0_11_match_after_the_upgrade(server: PgServer, empty_db: str
                                                         ) -> None:
    db = empty_db
    for path in sorted(MIGRATIONS.glob("*.sql")):
        if int(path.name[:4]) <= 11:
            server.run_psql(db, path, args=MIGRATION_PSQL_ARGS)
    ordinary = [v for v in VECTORS["fingerprint"]
                if v.get("defaults") is None and v.get("fields") is None]
    with psycopg.connect(db, autocommit=True) as owner, \
            login_roles(server, db, "request") as (role,):
        owner.execute("SELECT idempotency._premake()")
        with psycopg.connect(db, user=role, autocommit=True) as app:
            before = {v["name"]: bytes(app.execute(
                "SELECT idempotency.fingerprint(%s::jsonb)", (v["request"],)).fetchone()[0])
                for v in ordinary}
            for key, request in [("open", OPEN), ("done", DONE), ("fits", FITS),
                                 ("over", OVER)]:
                assert outcome(app, key, request) == "claimed"
            token = app.execute("SELECT lease_token FROM idempotency.claim('s', 'd2', "
                                "%s::jsonb)", (DONE,)).fetchone()[0]
            app.execute("SELECT idempotency.complete('s', 'd2', %s, 201, '{\"id\": 7}')",
                        (token,))
        server.run_psql(db, MIGRATIONS / "0012_bounded_canonical.sql", args=MIGRATION_PSQL_ARGS)

        with psycopg.connect(db, user=role, autocommit=True) as app:
            # Every fingerprint whose canonical text has no number with an exponent is the same.
            changed = []
            for v in ordinary:
                now = bytes(app.execute("SELECT idempotency.fingerprint(%s::jsonb)",
                                        (v["request"],)).fetchone()[0])
                has_exponent = isinstance(fingerprint(loads(v["request"])), LegacyFingerprint)
                assert (now == before[v["name"]]) is not has_exponent, v["name"]
                changed += [v["name"]] if has_exponent else []
            assert "number 1e40" in changed and "number 10" not in changed

            # Through the new SQL: the same requests match (strict too), others do not.
            for key, request in [("open", OPEN), ("fits", FITS)]:
                assert outcome(app, key, request) == "in_progress", key
                assert outcome(app, key, request, strict=True) == "in_progress", key
            assert outcome(app, "d2", DONE) == "replay"
            assert outcome(app, "open", OPEN.replace("1e30", "1e31")) == "mismatch"
            assert outcome(app, "open", '{"amount": 1}') == "mismatch"
            assert outcome(app, "over", OVER) == "mismatch"  # never a replay

            # Through the new package: its fingerprint of such a request carries 0.11.0's,
            # which it claims with after a mismatch.
            for key, request, expected in [("open", OPEN, Outcome.IN_PROGRESS),
                                           ("fits", FITS, Outcome.IN_PROGRESS),
                                           ("d2", DONE, Outcome.REPLAY),
                                           ("over", OVER, Outcome.MISMATCH)]:
                value = loads(request)
                assert api.claim(app, "s", key, value).outcome is expected, key
                assert api.claim(app, "s", key, value, strict=key != "over").outcome \
                    is expected, key
                # the adapters' way: claim(request=None, fingerprint=...)
                digest = fingerprint(value)
                assert isinstance(digest, LegacyFingerprint)
                assert api.claim(app, "s", key, None, fingerprint=digest).outcome is expected
            # strict: the old fingerprint mismatches too, so the server's IK002
            with pytest.raises(KeyMismatch):
                api.claim(app, "s", "over", loads(OVER), strict=True)
            replayed = api.claim(app, "s", "d2", loads(DONE))
            assert (replayed.response.status, replayed.response.body) == (201, {"id": 7})

            # A key claimed after the upgrade holds the new form: the SQL and the package agree.
            assert api.claim(app, "s", "new", loads(OPEN)).outcome is Outcome.CLAIMED
            assert outcome(app, "new", OPEN) == "in_progress"
            assert bytes(owner.execute(
                "SELECT fingerprint FROM idempotency.keys WHERE key = 'new'").fetchone()[0]) == \
                bytes(fingerprint(loads(OPEN)))
        # Nothing was written for the refused ones: the six keys claimed, no more.
        assert owner.execute("SELECT count(*) FROM idempotency.keys").fetchone() == (6,)
