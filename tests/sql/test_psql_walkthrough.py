"""The acceptance walk with plain psql only: install from migrations/, then one psql session
goes through claim, in_progress, complete, replay, mismatch, equivalent request, lease expiry
and takeover, and the fenced completion of the old token.

psql prints one ``label|value|...`` line per step (-A -t -F '|'); the test parses them.
"""

from __future__ import annotations

import json
from pathlib import Path

from pgharness import PgServer

ROOT = Path(__file__).resolve().parents[2]
MIGRATIONS = sorted((ROOT / "migrations").glob("*.sql"))
SEP = "|"

WALK = r"""
\set ON_ERROR_STOP 1
CREATE TABLE ledger (ref text NOT NULL, amount numeric NOT NULL);

-- 1. first attempt
SELECT outcome, lease_token, attempts
FROM idempotency.claim('payments', 'order-1', '{"amount": 50, "currency": "EUR"}')
\gset c1_
SELECT 'claim1', :'c1_outcome', :'c1_lease_token', :'c1_attempts';

-- 2. a retry while the first attempt runs
SELECT 'claim2', outcome, coalesce(lease_token::text, 'NULL'), retry_after > interval '0'
FROM idempotency.claim('payments', 'order-1', '{"amount": 50, "currency": "EUR"}');

-- 3. complete in the business transaction
BEGIN;
INSERT INTO ledger VALUES ('order-1', 50);
SELECT 'complete', idempotency.complete(
    'payments', 'order-1', :c1_lease_token, 201,
    '{"payment_id": "pay_1", "amount": 50, "tags": ["a", "b"]}',
    '{"Location": "/payments/pay_1", "X-Trace": "t-1"}') IS NOT NULL;
COMMIT;
SELECT 'ledger1', count(*) FROM ledger WHERE ref = 'order-1';

-- 4. a retry after completion replays the stored response
SELECT 'replay', outcome, response_status, response_body, response_headers,
       coalesce(lease_token::text, 'NULL')
FROM idempotency.claim('payments', 'order-1', '{"amount": 50, "currency": "EUR"}');

-- 5. the same key with a different request
SELECT 'mismatch', outcome, coalesce(response_status::text, 'NULL')
FROM idempotency.claim('payments', 'order-1', '{"amount": 51, "currency": "EUR"}');

-- 6. an equivalent request: keys reordered, 50.0 for 50, whitespace
SELECT 'equivalent', outcome, response_status, response_body, response_headers
FROM idempotency.claim('payments', 'order-1', '{ "currency":"EUR",  "amount":50.0 }');

-- 7. a 200 ms lease that runs out, then a retry takes the key over
SELECT outcome, lease_token
FROM idempotency.claim('payments', 'order-2', '{"amount": 7}', lease => '200 milliseconds')
\gset c3_
SELECT 'claim3', :'c3_outcome', :'c3_lease_token';
SELECT 'sleep', pg_sleep(0.3) IS NOT NULL;
SELECT outcome, lease_token, attempts
FROM idempotency.claim('payments', 'order-2', '{"amount": 7}')
\gset r_
SELECT 'resume', :'r_outcome', :'r_lease_token', :'r_attempts';

-- 8. the old owner finishes late: its completion and its ledger row must not commit
\set ON_ERROR_STOP 0
BEGIN;
INSERT INTO ledger VALUES ('order-2', 7);
SELECT 'stale', idempotency.complete('payments', 'order-2', :c3_lease_token, 200, '{}');
\echo stale_error|:LAST_ERROR_SQLSTATE
COMMIT;
\set ON_ERROR_STOP 1
SELECT 'ledger2', count(*) FROM ledger WHERE ref = 'order-2';
SELECT 'state2', state, lease_token FROM idempotency.keys WHERE key = 'order-2';

-- 9. the new owner completes
BEGIN;
INSERT INTO ledger VALUES ('order-2', 7);
SELECT 'complete2', idempotency.complete('payments', 'order-2', :r_lease_token, 200,
                                         '{"done": true}') IS NOT NULL;
COMMIT;
SELECT 'ledger3', count(*) FROM ledger WHERE ref = 'order-2';
SELECT 'replay2', outcome, response_status, response_body
FROM idempotency.claim('payments', 'order-2', '{"amount": 7}');
SELECT 'rows', count(*) FROM idempotency.keys;
"""


def parse_steps(stdout: str) -> dict[str, list[str]]:
    steps: dict[str, list[str]] = {}
    for line in stdout.splitlines():
        if not line.strip():
            continue
        label, *fields = line.split(SEP)
        assert label not in steps, f"step {label} printed twice:\n{stdout}"
        steps[label] = fields
    return steps


def test_acceptance_walk_with_plain_psql(server: PgServer, empty_db: str) -> None:
    assert MIGRATIONS, "no migrations/*.sql"
    for migration in MIGRATIONS:
        server.run_psql(empty_db, migration, args=("-X", "-v", "ON_ERROR_STOP=1", "-1"))

    proc = server.run_psql(empty_db, WALK, args=("-X", "-q", "-A", "-t", "-F", SEP),
                           check=False)
    assert proc.returncode == 0, f"psql exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    steps = parse_steps(proc.stdout)
    context = f"\n--- stdout ---\n{proc.stdout}--- stderr ---\n{proc.stderr}"

    outcome, token1, attempts = steps["claim1"]
    assert (outcome, attempts) == ("claimed", "1"), context
    token1_int = int(token1)

    assert steps["claim2"] == ["in_progress", "NULL", "t"], context

    assert steps["complete"] == ["t"], context
    assert steps["ledger1"] == ["1"], context

    expected_body = {"payment_id": "pay_1", "amount": 50, "tags": ["a", "b"]}
    expected_headers = {"Location": "/payments/pay_1", "X-Trace": "t-1"}
    outcome, status, body, headers, token = steps["replay"]
    assert (outcome, status, token) == ("replay", "201", "NULL"), context
    assert json.loads(body) == expected_body, context
    assert json.loads(headers) == expected_headers, context

    assert steps["mismatch"] == ["mismatch", "NULL"], context

    # Identical to the first replay, byte for byte as psql printed it.
    assert steps["equivalent"] == steps["replay"][:4], context

    outcome, token3 = steps["claim3"]
    assert outcome == "claimed", context
    outcome, token_resumed, attempts = steps["resume"]
    assert (outcome, attempts) == ("resumed", "2"), context
    # A new owner of a key gets a greater token, its high 32 bits at least one more than the
    # previous owner's (docs/design.md, "Lease tokens"); tokens of different keys (order-1,
    # order-2) are not ordered since 0.9.0, only different.
    assert int(token_resumed) > int(token3), context
    assert int(token_resumed) >> 32 >= (int(token3) >> 32) + 1, context
    assert int(token3) != token1_int and min(int(token3), token1_int) > 2**32, context

    assert "stale" not in steps, f"the stale completion must not return{context}"
    assert steps["stale_error"] == ["IK001"], context
    assert "IK001" in proc.stderr or "lease token" in proc.stderr, context
    assert steps["ledger2"] == ["0"], context
    assert steps["state2"] == ["in_progress", token_resumed], context

    assert steps["complete2"] == ["t"], context
    assert steps["ledger3"] == ["1"], context
    outcome, status, body = steps["replay2"]
    assert (outcome, status, json.loads(body)) == ("replay", "200", {"done": True}), context
    assert steps["rows"] == ["2"], context
