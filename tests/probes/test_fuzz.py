"""Seeded fuzz of every public function, called as the application roles (issue 13).

Two LOGIN roles are made as docs/install.md says, one per grant_usage kind (request,
completer), and every call picks one of them, a public function and hostile arguments: NULLs,
empty, control-character, odd-unicode and over-long names, huge and 200-deep JSON, unparsable
JSON, zero, negative, huge and infinite intervals, out-of-range integers, infinite or past
test clocks, wrong and other keys' lease tokens, other scopes' keys. After every call:

* a failed call raised a SQLSTATE listed in docs/errors.md, and changed nothing (the keys,
  key_directory, tombstones and inbox tables are compared before and after);
* one row per (scope, key) in keys and key_directory, each key with its directory row;
* every key is in_progress, completed or released; a completed key has a response, a released
  one neither a lease nor a response;
* no oracle: IK003 comes only from takeover(), and IK004 only to the caller whose token is the
  completed key's own (every other wrong token gets IK001);
* heartbeat_outcome, checkpoint_outcome and release_outcome (0.11.0) raise only for bad
  arguments, never IK001/IK003/IK004. Their lease_lost and completed answers changed nothing,
  are what the raising form with the same arguments raises (IK001, IK004: called right after,
  it must raise that and change nothing either), and completed goes only to the token that
  completed the key; ok left the key in progress under that token with the lease expiry it
  returned (release_outcome: released, no expiry);
* a claim that returned a stored response (replay, accepted) was given the request, or the
  fingerprint, the key was claimed with: no role reads a key it did not present.

Bounded by default (FUZZ_CALLS calls per flavour, a few seconds). The long version runs 20,000
calls per flavour: PG_IDEM_PROBES=long. The seed is PG_IDEM_FUZZ_SEED (default 13); a failure
names the seed and the call number so it can be replayed.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers import login_roles

from pgharness import PgServer

ROOT = Path(__file__).resolve().parents[2]
FUZZ_CALLS = 20000 if os.environ.get("PG_IDEM_PROBES") == "long" else 750
SEED = int(os.environ.get("PG_IDEM_FUZZ_SEED", "13"))


def documented_sqlstates() -> set[str]:
    text = (ROOT / "docs" / "errors.md").read_text()
    return set(re.findall(r"^\| `([0-9A-Z]{5})` \|", text, re.MULTILINE))


def deep(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


NAMES = ["k1", "k2", "k3", "pay-1", "a", "b", None, "", " ", "x" * 255, "x" * 256, "x" * 100_000,
         "\x01", "k\x7f", "k\u0085", "é🙂", "\u202ertl", "\ufeff", "'; DROP TABLE x; --",
         "%s", "\\", "\ud7ff"]
SCOPES = ["a", "b", "a", "b", None, "", "x" * 256, "\u0085", "🙂"]
JSONS = ['{}', '{"amount": 1}', '{"amount": 1.0}', '[]', 'null', '"s"', '1e300', '0e-16384',
         None, '{"a":', 'NaN', deep(128), deep(129), deep(600), '{"a": "' + "y" * 200_000 + '"}',
         # Over the 1 MiB default of settings.max_request_bytes / max_response_bytes: IK018.
         '{"a": "' + "z" * 1_100_000 + '"}',
         '{"\\u0000": 1}', '{"a": 1, "a": 2}', '{"k": "é🙂\\u202e"}', '1e131072']
HEADERS = ['{}', '{"Location": "/p/1"}', '[]', '{"": "x"}', '{"a b": "x"}', '{"X": 1}', None,
           '{"X": "a\\nb"}', '"s"']
INTERVALS = [None, '30 seconds', '1 second', '0', '-1 second', '1 day', '1 day 1 microsecond',
             'infinity', '-infinity', '10000 years', '1 microsecond', 'bogus', '178000000 years']
STATUSES = [None, '200', '201', '100', '599', '99', '600', '-1', '0', '2147483647',
            '2147483648', 'x']
TIMES = [None] * 6 + ['2026-01-01 00:00:00+00', 'infinity', '-infinity', '1960-01-01',
                      '10000000-01-01', 'nope']
BYTEAS = [None, '\\x', '\\x' + '00' * 32, '\\x' + 'ab' * 31, '\\x' + 'ff' * 33]
BOOLS = [None, 'true', 'false']
INTS = [None, '0', '1', '100', '10000', '10001', '-5', '2147483647', '9223372036854775808']

CALLS: dict[str, str] = {
    "claim": "SELECT * FROM idempotency.claim(%s::text, %s::text, %s::jsonb, "
             "coalesce(%s::interval, '30 seconds'), %s::bytea, coalesce(%s::boolean, false), "
             "%s::timestamptz)",
    "takeover": "SELECT * FROM idempotency.takeover(%s::text, %s::text, "
                "coalesce(%s::interval, '30 seconds'), %s::timestamptz)",
    "checkpoint": "SELECT idempotency.checkpoint(%s::text, %s::text, %s::bigint, %s::text, "
                  "%s::interval, %s::timestamptz)",
    "heartbeat": "SELECT idempotency.heartbeat(%s::text, %s::text, %s::bigint, "
                 "coalesce(%s::interval, '30 seconds'), %s::timestamptz)",
    "complete": "SELECT idempotency.complete(%s::text, %s::text, %s::bigint, %s::integer, "
                "%s::jsonb, %s::jsonb, %s::timestamptz)",
    "complete_bytes": "SELECT idempotency.complete_bytes(%s::text, %s::text, %s::bigint, "
                      "%s::integer, %s::bytea, %s::text, %s::jsonb, %s::timestamptz)",
    "accept": "SELECT idempotency.accept(%s::text, %s::text, %s::bigint, %s::integer, "
              "%s::jsonb, %s::jsonb, %s::interval, %s::timestamptz)",
    "release": "SELECT idempotency.release(%s::text, %s::text, %s::bigint)",
    "checkpoint_outcome": "SELECT * FROM idempotency.checkpoint_outcome(%s::text, %s::text, "
                          "%s::bigint, %s::text, %s::interval, %s::timestamptz)",
    "heartbeat_outcome": "SELECT * FROM idempotency.heartbeat_outcome(%s::text, %s::text, "
                         "%s::bigint, coalesce(%s::interval, '30 seconds'), %s::timestamptz)",
    "release_outcome": "SELECT * FROM idempotency.release_outcome(%s::text, %s::text, "
                       "%s::bigint)",
    "list_abandoned": "SELECT * FROM idempotency.list_abandoned(%s::integer, %s::text, "
                      "%s::timestamptz)",
    "inbox_accept": "SELECT idempotency.inbox_accept(%s::text, %s::text, %s::timestamptz)",
    "fingerprint": "SELECT idempotency.fingerprint(%s::jsonb, coalesce(%s::jsonb, '{}'), "
                   "%s::text[])",
    "canonical_json": "SELECT idempotency.canonical_json(%s::jsonb)",
    "derive_key": "SELECT idempotency.derive_key(%s::text, %s::text, %s::text)",
}
FIELDS = [None, '{}', '{a}', '{amount}', '{NULL}', '{{a,b},{c,d}}', '{"' + "f" * 300 + '"}']

SNAPSHOT = """
SELECT (SELECT coalesce(array_agg(t::text ORDER BY t::text), '{}') FROM idempotency.keys AS t),
       (SELECT coalesce(array_agg(t::text ORDER BY t::text), '{}')
        FROM idempotency.key_directory AS t),
       (SELECT coalesce(array_agg(t::text ORDER BY t::text), '{}')
        FROM idempotency.tombstones AS t),
       (SELECT coalesce(array_agg(t::text ORDER BY t::text), '{}') FROM idempotency.inbox AS t)
"""
# Each a count that must be zero.
INVARIANTS = """
SELECT
    (SELECT count(*) - count(DISTINCT (k.scope, k.key)) FROM idempotency.keys AS k),
    (SELECT count(*) - count(DISTINCT (d.scope, d.key_hash)) FROM idempotency.key_directory AS d),
    (SELECT count(*) FROM idempotency.keys AS k
     WHERE NOT EXISTS (SELECT FROM idempotency.key_directory AS d
                       WHERE d.scope = k.scope AND d.key_hash = sha256(convert_to(k.key, 'UTF8'))
                         AND d.created_at = k.created_at)),
    (SELECT count(*) FROM idempotency.keys AS k
     WHERE k.state IS NULL OR k.state NOT IN ('in_progress', 'completed', 'released')),
    (SELECT count(*) FROM idempotency.keys AS k
     WHERE k.state = 'completed' AND k.response_status IS NULL),
    (SELECT count(*) FROM idempotency.keys AS k
     WHERE k.state = 'released'
       AND (k.lease_expires_at IS NOT NULL OR k.response_status IS NOT NULL))
"""
#: The functions that take a lease token, and where it is among their arguments.
FENCED = ("checkpoint", "heartbeat", "complete", "complete_bytes", "accept", "release")
#: The outcome forms and their raising forms, which take the same arguments.
OUTCOME_FORMS = {"checkpoint_outcome": "checkpoint", "heartbeat_outcome": "heartbeat",
                 "release_outcome": "release"}
#: What the raising form raises where the outcome form answers.
RAISES = {"lease_lost": "IK001", "completed": "IK004"}
KEY_ROW = ("SELECT k.state, k.lease_token, k.lease_expires_at FROM idempotency.keys AS k "
           "WHERE k.scope = %s AND k.key = %s")


# The values each list starts with that a well-behaved caller passes; pick() takes one of them
# most of the time, so that enough calls get past the checks to reach the keys.
GOOD = {id(NAMES): 6, id(SCOPES): 4, id(JSONS): 3, id(HEADERS): 2, id(INTERVALS): 3,
        id(STATUSES): 5, id(TIMES): 6, id(BYTEAS): 3, id(BOOLS): 3, id(INTS): 5, id(FIELDS): 4}


def pick(rng: random.Random, values: list[Any]) -> Any:
    good = GOOD.get(id(values))
    if good and rng.random() < 0.75:
        return rng.choice(values[:good])
    return rng.choice(values)


def arguments(rng: random.Random, fn: str, tokens: list[str],
              held: dict[tuple[str, str], str],
              claimed_with: dict[tuple[str, str], tuple[Any, Any]]) -> tuple[Any, ...]:
    fn = OUTCOME_FORMS.get(fn, fn)  # the same arguments as the raising form
    scope, key = pick(rng, SCOPES), pick(rng, NAMES)
    owned = None
    if held and rng.random() < 0.5:  # a key some earlier claim or takeover got a token for
        (scope, key), owned = rng.choice(sorted(held.items()))

    def token() -> Any:
        if owned is not None and rng.random() < 0.8:
            return owned
        if tokens and rng.random() < 0.6:
            t = int(rng.choice(tokens))
            return str(t + rng.choice([0, 0, 0, 1, -1]))
        return pick(rng, INTS + ['-9223372036854775808', '9223372036854775807'])

    if fn == "claim":
        if owned is not None and (scope, key) in claimed_with and rng.random() < 0.5:
            # A retry of the request that got the key's token, so that replays (and what
            # they may reveal) are reached however the other calls fall.
            request, fingerprint = claimed_with[(scope, key)]
        else:
            fingerprint = pick(rng, BYTEAS) if rng.random() < 0.2 else None
            request = pick(rng, JSONS) if fingerprint is None or rng.random() < 0.3 else None
        return (scope, key, request, pick(rng, INTERVALS), fingerprint, pick(rng, BOOLS),
                pick(rng, TIMES))
    if fn == "takeover":
        return (scope, key, pick(rng, INTERVALS), pick(rng, TIMES))
    if fn == "checkpoint":
        return (scope, key, token(), pick(rng, NAMES), pick(rng, INTERVALS), pick(rng, TIMES))
    if fn == "heartbeat":
        return (scope, key, token(), pick(rng, INTERVALS), pick(rng, TIMES))
    if fn == "complete":
        return (scope, key, token(), pick(rng, STATUSES), pick(rng, JSONS), pick(rng, HEADERS),
                pick(rng, TIMES))
    if fn == "complete_bytes":
        return (scope, key, token(), pick(rng, STATUSES), pick(rng, BYTEAS),
                pick(rng, NAMES + ["application/pdf"]), pick(rng, HEADERS), pick(rng, TIMES))
    if fn == "accept":
        return (scope, key, token(), pick(rng, STATUSES), pick(rng, JSONS), pick(rng, HEADERS),
                pick(rng, INTERVALS), pick(rng, TIMES))
    if fn == "release":
        return (scope, key, token())
    if fn == "list_abandoned":
        return (pick(rng, INTS), pick(rng, SCOPES + [None, None]), pick(rng, TIMES))
    if fn == "inbox_accept":
        return (scope, key, pick(rng, TIMES))
    if fn == "fingerprint":
        return (pick(rng, JSONS), pick(rng, JSONS + [None] * 4), pick(rng, FIELDS))
    if fn == "canonical_json":
        return (pick(rng, JSONS),)
    return (scope, key, pick(rng, NAMES))


def check_outcome(owner: psycopg.Connection, conn: psycopg.Connection, where: str, fn: str,
                  args: tuple[Any, ...], rows: list[Any], before: Any) -> None:
    """What an answer of heartbeat_outcome, checkpoint_outcome or release_outcome says is so."""
    assert len(rows) == 1, (where, fn, rows)
    outcome, expires = rows[0]
    assert outcome in ("ok", "lease_lost", "completed"), (where, fn, rows)
    row = owner.execute(KEY_ROW, args[:2]).fetchone()
    if outcome == "ok":
        assert row is not None and row[1] == int(args[2]), (where, fn, args, row)
        if fn == "release_outcome":
            assert expires is None and row[0] == "released" and row[2] is None, (where, row)
        else:
            assert expires is not None and row[0] == "in_progress" and row[2] == expires, (
                where, fn, args, rows, row)
        return
    assert expires is None, (where, fn, rows)
    assert owner.execute(SNAPSHOT).fetchone() == before, (where, fn, outcome, "it wrote")
    # No oracle: completed only to the token that completed the key.
    assert (outcome == "completed") == (row is not None and row[:2] == (
        "completed", int(args[2]))), (where, fn, args, outcome, row)
    with pytest.raises(psycopg.Error) as raised:
        conn.execute(CALLS[OUTCOME_FORMS[fn]], args)
    assert raised.value.sqlstate == RAISES[outcome], (where, fn, outcome, str(raised.value))
    assert owner.execute(SNAPSHOT).fetchone() == before, (where, fn, "the raising form wrote")


def test_fuzz_every_public_function_as_the_application_roles(server: PgServer, db: str) -> None:
    documented = documented_sqlstates()
    assert {"IK001", "IK010", "IK014", "42501", "22P02"} <= documented, documented
    rng = random.Random(SEED)
    tokens: list[str] = []
    held: dict[tuple[str, str], str] = {}
    claimed_with: dict[tuple[str, str], tuple[Any, Any]] = {}  # (request, fingerprint)
    seen: dict[str, int] = {}
    failures = 0
    kinds = ("request", "completer")
    with login_roles(server, db, *kinds) as roles, psycopg.connect(db, autocommit=True) as owner:
        conns = {kind: psycopg.connect(db, user=role, autocommit=True, prepare_threshold=None)
                 for kind, role in zip(kinds, roles, strict=True)}
        try:
            for n in range(FUZZ_CALLS):
                where = f"seed {SEED}, call {n}"
                kind = "completer" if rng.random() < 0.3 else "request"
                fn = rng.choice(sorted(CALLS))
                args = arguments(rng, fn, tokens, held, claimed_with)
                before = owner.execute(SNAPSHOT).fetchone()
                try:
                    cur = conns[kind].execute(CALLS[fn], args)
                    rows = cur.fetchall() if cur.description else []
                except psycopg.Error as err:
                    failures += 1
                    state = err.sqlstate or "client"
                    seen[state] = seen.get(state, 0) + 1
                    assert state in documented, (where, kind, fn, state, str(err)[:300])
                    assert state not in ("P0001", "XX000"), (where, fn, str(err)[:300])
                    after = owner.execute(SNAPSHOT).fetchone()
                    assert after == before, (where, kind, fn, "a failed call changed rows")
                    # No oracle: a key's state is told only to its owner.
                    assert state != "IK003" or fn == "takeover", (where, fn, str(err)[:300])
                    # The outcome forms answer where the raising forms raise.
                    assert fn not in OUTCOME_FORMS or state not in ("IK001", "IK004"), (
                        where, fn, str(err)[:300])
                    if state == "IK004":
                        assert fn in FENCED, (where, fn, str(err)[:300])
                        assert owner.execute(
                            "SELECT k.state, k.lease_token FROM idempotency.keys AS k "
                            "WHERE k.scope = %s AND k.key = %s", args[:2]).fetchone() == (
                            "completed", int(args[2])), (where, fn, args, "IK004 to a stranger")
                    continue
                seen["ok"] = seen.get("ok", 0) + 1
                if fn in OUTCOME_FORMS:
                    check_outcome(owner, conns[kind], where, fn, args, rows, before)
                    seen[f"outcome:{rows[0][0]}"] = seen.get(f"outcome:{rows[0][0]}", 0) + 1
                if fn in ("claim", "takeover") and rows:
                    outcome, token = rows[0][0], rows[0][1]
                    seen[f"{fn}:{outcome}"] = seen.get(f"{fn}:{outcome}", 0) + 1
                    if token is not None:
                        tokens.append(str(token))
                        held[(args[0], args[1])] = str(token)
                        if fn == "claim":
                            claimed_with[(args[0], args[1])] = (args[2], args[4])
                    if fn == "claim" and outcome in ("replay", "accepted"):
                        # The stored response went only to a caller that presented the key's
                        # own request (or fingerprint).
                        given = args[4] if args[2] is None else None
                        stored, presented = owner.execute(
                            "SELECT k.fingerprint, coalesce(%s::bytea, sha256(convert_to("
                            "idempotency.canonical_json(%s::jsonb), 'UTF8'))) "
                            "FROM idempotency.keys AS k WHERE k.scope = %s AND k.key = %s",
                            (given, args[2], args[0], args[1])).fetchone()
                        assert stored == presented, (where, "replay without the request")
                bad = owner.execute(INVARIANTS).fetchone()
                assert bad == (0, 0, 0, 0, 0, 0), (where, kind, fn, args, bad)
        finally:
            for conn in conns.values():
                conn.close()
    print(f"fuzz seed {SEED}: {FUZZ_CALLS} calls, {sorted(seen.items())}")
    # The fuzz reached both sides: successes and refusals of several kinds.
    assert seen.get("ok", 0) > FUZZ_CALLS // 20, seen
    assert failures > FUZZ_CALLS // 4, seen
    assert {"IK001", "IK003", "IK004", "IK010", "IK011", "IK012", "IK018", "42501",
            "claim:replay", "outcome:ok", "outcome:lease_lost", "outcome:completed"} <= set(
        seen), sorted(seen.items())
