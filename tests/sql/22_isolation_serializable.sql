-- IK005: claim() and inbox_accept() refuse to run under SERIALIZABLE (their lookup across
-- partitions needs a snapshot taken after the key lock), while the functions that never insert
-- (checkpoint, heartbeat, complete, takeover, list_abandoned) work at this level.
--
-- The isolation level can only be set before the first query of a transaction, so it is set
-- right after BEGIN (SET LOCAL transaction_isolation: the same as SET TRANSACTION ISOLATION
-- LEVEL, which sqlfluff cannot parse), and this whole file runs at SERIALIZABLE.
-- Keys are inserted directly, since claim cannot make them here (the test runs as the owner).
BEGIN;

SET LOCAL transaction_isolation = 'serializable';

SELECT plan(14);

SELECT is(
    current_setting('transaction_isolation'), 'serializable',
    'this file runs at SERIALIZABLE'
);
SELECT throws_ok(
    $$SELECT idempotency.claim('iso', 'k', '{}')$$,
    'IK005', 'idempotency.claim must run at READ COMMITTED, not SERIALIZABLE',
    'claim under SERIALIZABLE: IK005'
);
SELECT throws_ok(
    $$SELECT idempotency.claim('iso', 'k', NULL, fingerprint => sha256('x'))$$,
    'IK005', NULL,
    'claim with a caller fingerprint under SERIALIZABLE: IK005'
);
SELECT throws_ok(
    $$SELECT idempotency.inbox_accept('iso', 'm')$$,
    'IK005', 'idempotency.inbox_accept must run at READ COMMITTED, not SERIALIZABLE',
    'inbox_accept under SERIALIZABLE: IK005'
);
SELECT is_empty(
    $$SELECT FROM idempotency.keys WHERE scope = 'iso'$$,
    'the refused claims wrote nothing'
);
SELECT is_empty(
    $$SELECT FROM idempotency.inbox WHERE consumer = 'iso'$$,
    'the refused inbox_accept wrote nothing'
);

INSERT INTO idempotency.keys (
    scope, key, fingerprint, state, lease_token, lease_expires_at, created_at
)
VALUES
(
    'iso', 'live', idempotency.fingerprint('{}'), 'in_progress',
    idempotency._new_token(NULL), now() + interval '30 seconds', now()
),
(
    'iso', 'expired', idempotency.fingerprint('{}'), 'in_progress',
    idempotency._new_token(NULL), now() - interval '1 second',
    now() - interval '31 seconds'
);
-- Rows made by hand need their directory rows too (claim() writes both).
INSERT INTO idempotency.key_directory (scope, key_hash, created_at)
SELECT
    k.scope,
    sha256(convert_to(k.key, 'UTF8')) AS key_hash,
    k.created_at
FROM idempotency.keys AS k
WHERE k.scope = 'iso';

-- token(key): the current lease token of a key of scope iso.
CREATE FUNCTION pg_temp.token(key text)
RETURNS bigint
LANGUAGE sql
STABLE
AS $$ SELECT k.lease_token FROM idempotency.keys AS k WHERE k.scope = 'iso' AND k.key = $1 $$;

SELECT is(
    idempotency.checkpoint(
        'iso', 'live',
        pg_temp.token('live'),
        'step-1', reference_time => now()
    ),
    now() + interval '30 seconds',
    'checkpoint works under SERIALIZABLE'
);
SELECT is(
    idempotency.heartbeat(
        'iso', 'live',
        pg_temp.token('live'),
        '1 minute', reference_time => now()
    ),
    now() + interval '1 minute',
    'heartbeat works under SERIALIZABLE'
);
SELECT results_eq(
    $$SELECT scope, key FROM idempotency.list_abandoned(scope => 'iso', reference_time => now())$$,
    $$VALUES ('iso'::text, 'expired'::text)$$,
    'list_abandoned works under SERIALIZABLE'
);
SELECT is(
    (idempotency.takeover('iso', 'expired', reference_time => now())).outcome,
    'resumed',
    'takeover works under SERIALIZABLE'
);
SELECT is(
    idempotency.complete(
        'iso', 'live',
        pg_temp.token('live'),
        200, '{"ok": true}', reference_time => now()
    ),
    now(),
    'complete works under SERIALIZABLE'
);
SELECT results_eq(
    $$SELECT state, response_status, recovery_point FROM idempotency.keys
      WHERE scope = 'iso' AND key = 'live'$$,
    $$VALUES ('completed'::text, 200, 'step-1'::text)$$,
    'the key was completed with its recovery point'
);
SELECT is(
    (idempotency.takeover('iso', 'live', reference_time => now())).response_body,
    '{"ok": true}'::jsonb,
    'takeover replays the completed key under SERIALIZABLE'
);
SELECT throws_ok(
    $$SELECT idempotency.claim('iso', 'live', '{}')$$,
    'IK005', NULL,
    'claim of an existing key under SERIALIZABLE: still IK005 (no replay at this level)'
);

SELECT * FROM finish();

ROLLBACK;
