-- The engine's clock and where keys are looked up (Engine v2): reference_time is a test clock
-- that only the schema owner may pass; no value of it gives a key a second row, an infinite
-- lease, or an undocumented SQLSTATE, because lookups go through idempotency.key_directory
-- and no time bound decides where a key is searched.
BEGIN;

SELECT plan(22);

CREATE ROLE idem_t45_app NOLOGIN;
SELECT idempotency.grant_usage('idem_t45_app');
SELECT idempotency.grant_usage('idem_t45_app', kind => 'completer');

-- as_app(sql): run one statement as the application role (SET LOCAL ROLE, as 40_privileges).
CREATE FUNCTION pg_temp.as_app(sql text)
RETURNS text
LANGUAGE plpgsql
AS $$
DECLARE
    v_result text;
BEGIN
    PERFORM set_config('role', 'idem_t45_app', true);
    EXECUTE sql INTO v_result;
    PERFORM set_config('role', 'none', true);
    RETURN v_result;
END;
$$;

-- rows(scope, key): how many rows of keys and of the directory the key has.
CREATE FUNCTION pg_temp.rows(p_scope text, p_key text)
RETURNS text
LANGUAGE sql
AS $$
    SELECT format('%s keys, %s directory',
        (SELECT count(*) FROM idempotency.keys AS k WHERE k.scope = p_scope AND k.key = p_key),
        (SELECT count(*) FROM idempotency.key_directory AS d
         WHERE d.scope = p_scope AND d.key_hash = sha256(convert_to(p_key, 'UTF8'))))
$$;

-- The application role cannot move the clock ---------------------------------------------------

SELECT throws_ok(
    $$SELECT pg_temp.as_app($q$SELECT (idempotency.claim('acct_42', 'order-2', '{"amount": 50}',
        reference_time => clock_timestamp() - interval '2 hours')).outcome$q$)$$,
    'IK017', 'idempotency.claim: argument "reference_time" may be passed only by the owner of '
    || 'schema idempotency',
    'app role: claim with a reference_time: IK017'
);
SELECT is(
    pg_temp.rows('acct_42', 'order-2'), '0 keys, 0 directory',
    'the refused claim wrote nothing'
);
SELECT is(
    pg_temp.as_app(
        $q$SELECT (idempotency.claim('acct_42', 'order-2', '{"amount": 50}')).outcome$q$
    ),
    'claimed', 'app role: the same claim without reference_time is claimed'
);
SELECT throws_ok(
    format(
        $$SELECT pg_temp.as_app('SELECT idempotency.heartbeat(''acct_42'', ''order-2'', %s,
        ''1 day'', reference_time => ''infinity'')')$$,
        (
            SELECT lease_token FROM idempotency.keys
            WHERE key = 'order-2'
        )
    ),
    'IK017', NULL,
    'app role: heartbeat with reference_time => infinity: IK017'
);
SELECT is(
    (
        SELECT lease_expires_at < clock_timestamp() + interval '1 minute'
        FROM idempotency.keys
        WHERE key = 'order-2'
    ),
    true, 'and the lease is still the 30 seconds the claim gave'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_app($q$SELECT count(*) FROM idempotency.list_abandoned(
        reference_time => 'infinity')$q$)$$,
    'IK017', NULL, 'app role: list_abandoned with a reference_time: IK017'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_app($q$SELECT idempotency.inbox_accept('c', 'm',
        reference_time => '2000-01-01')$q$)$$,
    'IK017', NULL, 'app role: inbox_accept with a reference_time: IK017'
);

-- The owner's test clock is checked ------------------------------------------------------------

SELECT throws_ok(
    $$SELECT idempotency.claim('owner', 'inf', '{}', reference_time => 'infinity')$$,
    'IK014', 'idempotency.claim: argument "reference_time" must be a finite time from 1970 to 9998',
    'owner: reference_time => infinity: IK014 (not 23505, not 22008)'
);
SELECT throws_ok(
    $$SELECT idempotency.claim('owner', 'inf', '{}', reference_time => '-infinity')$$,
    'IK014', NULL, 'owner: reference_time => -infinity: IK014'
);
SELECT throws_ok(
    $$SELECT idempotency.claim('owner', 'inf', '{}', reference_time => '9999-06-01')$$,
    'IK014', NULL, 'owner: reference_time in the year 9999: IK014 (a lease would overflow)'
);
SELECT is(pg_temp.rows('owner', 'inf'), '0 keys, 0 directory', 'none of them wrote anything');

-- No value of the clock gives a key a second row -----------------------------------------------

SELECT is(
    (idempotency.claim('owner', 'order-2', '{"amount": 50}')).outcome, 'claimed',
    'owner: a key claimed now'
);
SELECT is(
    (idempotency.claim(
        'owner', 'order-2', '{"amount": 50}',
        reference_time => clock_timestamp() - interval '2 hours'
    )).outcome,
    'in_progress',
    'the same key claimed with the clock 2 hours back is in progress, not claimed'
);
SELECT is(
    (idempotency.claim(
        'owner', 'order-2', '{"amount": 50}',
        reference_time => clock_timestamp() - interval '400 days'
    )).outcome,
    'in_progress',
    'and with the clock 400 days back too'
);
SELECT is(
    (idempotency.claim(
        'owner', 'order-2', '{"amount": 51}',
        reference_time => clock_timestamp() + interval '3 hours'
    )).outcome,
    'mismatch',
    'a different request 3 hours ahead is a mismatch'
);
SELECT is(
    pg_temp.rows('owner', 'order-2'), '1 keys, 1 directory',
    'one row in keys and one in the directory'
);

-- A key claimed 90 minutes ahead is found and completed with its token.
SELECT is(
    (idempotency.claim(
        'owner', 'ahead', '{}',
        reference_time => clock_timestamp() + interval '90 minutes'
    )).outcome,
    'claimed', 'owner: a key claimed 90 minutes ahead'
);
SELECT lives_ok(
    format(
        $$SELECT idempotency.complete('owner', 'ahead', %s, 201, '{"ok": true}')$$,
        (
            SELECT lease_token FROM idempotency.keys
            WHERE key = 'ahead'
        )
    ),
    'completes now with its token'
);
SELECT is(
    (idempotency.claim('owner', 'ahead', '{}')).outcome, 'replay', 'and replays now'
);

-- A key far in the past, in keys_default, is found through the directory as well.
SELECT is(
    (idempotency.claim('owner', 'old', '{}', reference_time => '1999-01-01')).outcome,
    'claimed', 'owner: a key dated 1999 (in the default partitions)'
);
SELECT is(
    (idempotency.claim('owner', 'old', '{}')).outcome, 'resumed',
    'is found now: its lease expired long ago, so it is resumed, not claimed again'
);
SELECT is(pg_temp.rows('owner', 'old'), '1 keys, 1 directory', 'still one row each');

SELECT * FROM finish();

ROLLBACK;
