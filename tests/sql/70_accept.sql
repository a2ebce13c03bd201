-- Long-running operations: accept() stores an interim response on a key in progress; claims
-- under the live lease get outcome accepted with it (the same answer every time), the owner
-- heartbeats and completes with its token, a stale token is fenced off, an expired lease is
-- taken over (resumed), and after complete every claim replays the final response.
--
-- Time is controlled with reference_time relative to now(), frozen for the transaction.
BEGIN;

SELECT plan(35);

CREATE TEMP TABLE res ON COMMIT DROP AS
SELECT
    ''::text AS tag,
    c.*
FROM idempotency.claim('-', '-', '{}') AS c
WITH NO DATA;

ALTER TABLE res ADD PRIMARY KEY (tag);

-- keep(tag, result): record a claim or takeover result under a tag.
CREATE FUNCTION pg_temp.keep(tag text, result idempotency.claim_result)
RETURNS void
LANGUAGE sql
AS $$ INSERT INTO res SELECT tag, (result).* $$;

-- r(tag): the result recorded under tag.
CREATE FUNCTION pg_temp.r(tag text)
RETURNS pg_temp.res
LANGUAGE sql
STABLE
AS $$ SELECT * FROM res WHERE res.tag = r.tag $$;

-- c(tag, seconds): claim the test key at now() + seconds and keep the result under tag.
CREATE FUNCTION pg_temp.c(tag text, seconds integer)
RETURNS void
LANGUAGE sql
AS $$
    SELECT pg_temp.keep(tag, idempotency.claim(
        scope => 'ac', key => 'k1', request => '{"capture": 50}', lease => '10 seconds',
        reference_time => now() + make_interval(secs => seconds)))
$$;

SELECT pg_temp.c('first', 0);

-- accept: the interim response, the lease extension ---------------------------------------------

SELECT is(
    idempotency.accept(
        scope => 'ac', key => 'k1', lease_token => (pg_temp.r('first')).lease_token,
        status => 202, body => '{"status_url": "/captures/k1", "state": "pending"}',
        headers => '{"Location": "/captures/k1"}', lease => '60 seconds',
        reference_time => now() + interval '1 second'
    ),
    now() + interval '61 seconds',
    'accept with lease: returns the lease expiry, extended to at least now + lease'
);
SELECT results_eq(
    $$SELECT state, response_status, response_body, response_headers, response_content_type,
             completed_at
      FROM idempotency.keys WHERE scope = 'ac' AND key = 'k1'$$,
    $$VALUES ('in_progress'::text, 202,
              '{"status_url": "/captures/k1", "state": "pending"}'::jsonb,
              '{"Location": "/captures/k1"}'::jsonb, 'application/json'::text,
              NULL::timestamptz)$$,
    'accept: the key stays in_progress and holds the interim response'
);
SELECT is(
    idempotency.accept(
        scope => 'ac', key => 'k1', lease_token => (pg_temp.r('first')).lease_token,
        status => 202, body => '{"status_url": "/captures/k1", "state": "pending"}',
        headers => '{"Location": "/captures/k1"}', reference_time => now() + interval '2 seconds'
    ),
    now() + interval '61 seconds',
    'accept without lease: the lease is left as it is'
);

-- Claims under the live lease: accepted, the same answer each time ----------------------------

SELECT pg_temp.c('retry' || i, 2 + i) FROM generate_series(1, 20) AS i;

SELECT is_empty(
    $$SELECT FROM res WHERE tag LIKE 'retry%' AND outcome <> 'accepted'$$,
    'twenty claims under the live lease: all accepted'
);
SELECT is(
    (
        SELECT count(*) FROM (
            SELECT DISTINCT
                response_status,
                response_headers,
                response_body,
                response_content_type
            FROM res
            WHERE tag LIKE 'retry%'
        ) AS d
    ),
    1::bigint,
    'twenty claims: one and the same interim response'
);
SELECT is(
    (pg_temp.r('retry1')).response_body, '{"status_url": "/captures/k1", "state": "pending"}',
    'accepted: the interim body'
);
SELECT is(
    (pg_temp.r('retry1')).response_status, 202,
    'accepted: the interim status'
);
SELECT is(
    (pg_temp.r('retry1')).response_headers, '{"Location": "/captures/k1"}',
    'accepted: the interim headers'
);
SELECT is(
    (pg_temp.r('retry1')).retry_after, interval '58 seconds',
    'accepted: retry_after is the time left on the lease'
);
SELECT is_empty(
    $$SELECT FROM res WHERE tag LIKE 'retry%'
      AND NOT (lease_token IS NULL AND completed_at IS NULL AND attempts = 1)$$,
    'accepted: no token (never another owner''s), no completed_at, attempts 1'
);
SELECT is(
    (SELECT outcome FROM idempotency.takeover(
        scope => 'ac', key => 'k1', reference_time => now() + interval '30 seconds'
    )),
    'accepted',
    'takeover under the live lease: accepted, not taken over'
);

-- Heartbeat keeps it accepted --------------------------------------------------------------------

SELECT is(
    idempotency.heartbeat(
        scope => 'ac', key => 'k1', lease_token => (pg_temp.r('first')).lease_token,
        lease => '60 seconds', reference_time => now() + interval '50 seconds'
    ),
    now() + interval '110 seconds',
    'heartbeat of an accepted key extends its lease'
);
SELECT pg_temp.c('after_heartbeat', 100);
SELECT is(
    (pg_temp.r('after_heartbeat')).outcome, 'accepted',
    'after the heartbeat, past the first expiry: still accepted'
);

-- Expiry: taken over (resumed) with the recovery point -----------------------------------------

SELECT ok(
    idempotency.checkpoint(
        scope => 'ac', key => 'k1', lease_token => (pg_temp.r('first')).lease_token,
        recovery_point => 'processor_called', reference_time => now() + interval '101 seconds'
    )
    IS NOT NULL,
    'checkpoint of an accepted key'
);
SELECT pg_temp.c('expired', 111);
SELECT is(
    (pg_temp.r('expired')).outcome, 'resumed',
    'claim after the lease expired: resumed'
);
SELECT is(
    (pg_temp.r('expired')).recovery_point, 'processor_called',
    'resumed: with the recovery point'
);
SELECT cmp_ok(
    (pg_temp.r('expired')).lease_token, '>', (pg_temp.r('first')).lease_token,
    'resumed: a higher token'
);
SELECT is(
    (pg_temp.r('expired')).attempts, 2,
    'resumed: attempts 2'
);
SELECT pg_temp.c('after_takeover', 112);
SELECT is(
    ((pg_temp.r('after_takeover')).outcome, (pg_temp.r('after_takeover')).response_body),
    ('accepted'::text, '{"status_url": "/captures/k1", "state": "pending"}'::jsonb),
    'after the takeover, under the new lease: the same interim response'
);

-- Fencing: the old token is refused -------------------------------------------------------------

SELECT throws_ok(
    format(
        $$SELECT idempotency.accept('ac', 'k1', %s, 202, '{}')$$,
        (pg_temp.r('first')).lease_token
    ),
    'IK001',
    format(
        'idempotency.accept: lease token %s is not the current one for key "k1" in scope "ac"',
        (pg_temp.r('first')).lease_token
    ),
    'accept with the token that was taken over: IK001'
);
SELECT throws_ok(
    format(
        $$SELECT idempotency.complete('ac', 'k1', %s, 200, '{}')$$,
        (pg_temp.r('first')).lease_token
    ),
    'IK001',
    NULL,
    'complete with the token that was taken over: IK001'
);
SELECT throws_ok(
    $$SELECT idempotency.accept('ac', 'nope', 1, 202, '{}')$$,
    'IK001',
    'idempotency.accept: lease token 1 is not the current one for key "nope" in scope "ac"',
    'accept of a key that does not exist: IK001, as for a wrong token (no oracle)'
);

-- Complete after accept: the final response replaces the interim one ----------------------------

SELECT ok(
    idempotency.complete(
        scope => 'ac', key => 'k1', lease_token => (pg_temp.r('expired')).lease_token,
        status => 200, body => '{"state": "captured", "id": "cap_1"}', headers => '{}',
        reference_time => now() + interval '115 seconds'
    )
    IS NOT NULL,
    'complete by the new owner after accept'
);
SELECT pg_temp.c('final1', 116);
SELECT pg_temp.c('final2', 500);
SELECT results_eq(
    $$SELECT outcome, response_status, response_body, response_headers
      FROM res WHERE tag IN ('final1', 'final2') ORDER BY tag$$,
    $$VALUES ('replay'::text, 200, '{"state": "captured", "id": "cap_1"}'::jsonb, '{}'::jsonb),
             ('replay'::text, 200, '{"state": "captured", "id": "cap_1"}'::jsonb, '{}'::jsonb)$$,
    'claims after complete: replay of the final response, not the interim one'
);
SELECT throws_ok(
    format(
        $$SELECT idempotency.accept('ac', 'k1', %s, 202, '{}')$$,
        (pg_temp.r('expired')).lease_token
    ),
    'IK004',
    NULL,
    'accept after complete: IK004'
);

-- Without accept nothing changes: in_progress ---------------------------------------------------

SELECT pg_temp.keep('plain', idempotency.claim('ac', 'k2', '{}', reference_time => now()));
SELECT pg_temp.keep('plain_again', idempotency.claim('ac', 'k2', '{}', reference_time => now()));
SELECT is(
    ((pg_temp.r('plain_again')).outcome, (pg_temp.r('plain_again')).response_status),
    ('in_progress'::text, NULL::integer),
    'a key in progress without accept: in_progress, no response'
);

-- A rolled back accept leaves no interim response ----------------------------------------------

-- crash_after_accept(token): accept, then fail in the same transaction (here a subtransaction).
CREATE FUNCTION pg_temp.crash_after_accept(token bigint)
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    PERFORM idempotency.accept('ac', 'k2', crash_after_accept.token, 202, '{"a": 1}');
    RAISE EXCEPTION 'injected crash';
END;
$$;

SELECT throws_ok(
    format('SELECT pg_temp.crash_after_accept(%s)', (pg_temp.r('plain')).lease_token),
    'P0001',
    'injected crash',
    'a failure after accept in the same transaction'
);
SELECT is(
    (SELECT outcome FROM idempotency.claim('ac', 'k2', '{}', reference_time => now())),
    'in_progress',
    'accept rolled back with its transaction: in_progress again'
);

-- Arguments ---------------------------------------------------------------------------------------

SELECT throws_ok(
    format(
        $$SELECT idempotency.accept('ac', 'k2', %s, 99, '{}')$$,
        (pg_temp.r('plain')).lease_token
    ),
    'IK014',
    'idempotency.accept: argument "status" must be an HTTP status code (100 to 599)',
    'accept: status out of range is IK014'
);
SELECT throws_ok(
    $$SELECT idempotency.accept('ac', 'k2', NULL, 202, '{}')$$,
    'IK010',
    'idempotency.accept: argument "lease_token" must not be NULL',
    'accept: a NULL token is IK010'
);
SELECT throws_ok(
    format(
        $$SELECT idempotency.accept('ac', 'k2', %s, 202, '{}', lease => '2 days')$$,
        (pg_temp.r('plain')).lease_token
    ),
    'IK014',
    'idempotency.accept: argument "lease" must be greater than 0 and at most 1 day',
    'accept: a lease over 1 day is IK014'
);
SELECT throws_ok(
    format(
        $$SELECT idempotency.accept('ac', 'k2', %s, 202, '{}', headers => '[1]')$$,
        (pg_temp.r('plain')).lease_token
    ),
    'IK015',
    NULL,
    'accept: headers not an object is IK015'
);
SELECT throws_ok(
    $$SELECT idempotency.accept('', 'k2', 1, 202, '{}')$$,
    'IK011',
    NULL,
    'accept: an empty scope is IK011'
);

-- Invariant: an in_progress row has a lease; a response on it is an interim one ----------------

SELECT is_empty(
    $$SELECT FROM idempotency.keys
      WHERE NOT coalesce(
          (state = 'in_progress' AND lease_expires_at IS NOT NULL AND completed_at IS NULL)
          OR (state = 'completed' AND response_status IS NOT NULL AND completed_at IS NOT NULL),
          false)$$,
    'invariant: in_progress rows have a lease and no completed_at, completed rows a status'
);
SELECT has_function(
    'idempotency', 'accept',
    ARRAY[
        'text', 'text', 'bigint', 'integer', 'jsonb', 'jsonb', 'interval',
        'timestamp with time zone'
    ],
    'accept has the documented signature'
);

SELECT * FROM finish();

ROLLBACK;
