-- The key lifecycle: claim, in_progress, mismatch, checkpoint, heartbeat, complete, replay,
-- expiry and resume, fencing of stale tokens, release, takeover, list_abandoned.
--
-- Time is controlled with reference_time, relative to now(), which is frozen for the whole
-- transaction; so every expected instant is exact and the rows land in the partitions made at
-- install (today and the next days). Every claim result is kept in the temp table res, in call
-- order (seq), under a tag whose first '_'-separated part names the key, so later steps can use
-- its lease token and the last tests can check the order of the tokens each key was handed.
BEGIN;

SELECT plan(116);

CREATE TEMP TABLE res ON COMMIT DROP AS
SELECT
    ''::text AS tag,
    c.*
FROM idempotency.claim('-', '-', '{}') AS c
WITH NO DATA;

ALTER TABLE res ADD COLUMN seq bigint GENERATED ALWAYS AS IDENTITY;
ALTER TABLE res ADD PRIMARY KEY (tag);

-- keep(tag, result): record a claim or takeover result under a tag, in call order.
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

-- k(scope, key): the row of a key (the invariants below check there is only one).
CREATE FUNCTION pg_temp.k(scope text, key text)
RETURNS idempotency.keys
LANGUAGE sql
STABLE
AS $$ SELECT * FROM idempotency.keys AS k WHERE k.scope = $1 AND k.key = $2 $$;

-- answer(call): what a call that fails tells its caller, as
-- 'SQLSTATE | message | DETAIL | HINT' ('no error' if it succeeds). Inside an exception block, so
-- whatever the call did is rolled back.
CREATE FUNCTION pg_temp.answer(call text)
RETURNS text
LANGUAGE plpgsql
AS $$
DECLARE
    v_state text;
    v_message text;
    v_detail text;
    v_hint text;
BEGIN
    EXECUTE call;
    RETURN 'no error';
EXCEPTION WHEN OTHERS THEN
    GET STACKED DIAGNOSTICS v_state = RETURNED_SQLSTATE, v_message = MESSAGE_TEXT,
                            v_detail = PG_EXCEPTION_DETAIL, v_hint = PG_EXCEPTION_HINT;
    RETURN concat_ws(' | ', v_state, v_message, v_detail, v_hint);
END
$$;

-- n(scope, key): how many rows the key has.
CREATE FUNCTION pg_temp.n(scope text, key text)
RETURNS bigint
LANGUAGE sql
STABLE
AS $$ SELECT count(*) FROM idempotency.keys AS k WHERE k.scope = $1 AND k.key = $2 $$;

SELECT pg_temp.keep('k1_claim', idempotency.claim(
    scope => 'lc', key => 'k1',
    request => '{"amount": 50, "currency": "EUR", "items": [{"sku": "a-1", "qty": 2}]}',
    lease => '30 seconds', reference_time => now()
));

-- Claim of a new key ---------------------------------------------------------------------------

SELECT is(
    (pg_temp.r('k1_claim')).outcome, 'claimed',
    'claim of a new key: outcome claimed'
);
SELECT cmp_ok(
    (pg_temp.r('k1_claim')).lease_token, '>', 0::bigint,
    'claim of a new key: a positive lease token'
);
SELECT is(
    (pg_temp.r('k1_claim')).lease_expires_at, now() + interval '30 seconds',
    'claim of a new key: lease_expires_at = reference_time + lease'
);
SELECT is(
    (pg_temp.r('k1_claim')).attempts, 1,
    'claim of a new key: attempts 1'
);
SELECT is(
    (pg_temp.r('k1_claim')).created_at, now(),
    'claim of a new key: created_at = reference_time'
);
SELECT is_empty(
    $$SELECT FROM res WHERE tag = 'k1_claim'
      AND NOT (recovery_point IS NULL AND response_status IS NULL AND response_body IS NULL
               AND response_headers IS NULL AND retry_after IS NULL AND completed_at IS NULL)$$,
    'claim of a new key: no recovery point, no response, no retry_after'
);
SELECT results_eq(
    $$SELECT state, lease_token, lease_expires_at, attempts, fingerprint, recovery_point,
             created_at
      FROM idempotency.keys WHERE scope = 'lc' AND key = 'k1'$$,
    $$SELECT 'in_progress'::text, r.lease_token, now() + interval '30 seconds', 1,
             idempotency.fingerprint(
                 '{"amount": 50, "currency": "EUR", "items": [{"sku": "a-1", "qty": 2}]}'),
             NULL::text, now()
      FROM res AS r WHERE r.tag = 'k1_claim'$$,
    'claim of a new key: one in_progress row with the token, expiry, attempts and fingerprint'
);

-- Second claim of the same request while the lease is live -------------------------------------

SELECT pg_temp.keep('k1_again', idempotency.claim(
    scope => 'lc', key => 'k1',
    request => '{"amount": 50, "currency": "EUR", "items": [{"sku": "a-1", "qty": 2}]}',
    reference_time => now() + interval '5 seconds'
));

SELECT is(
    (pg_temp.r('k1_again')).outcome, 'in_progress',
    'same request during a live lease: in_progress'
);
SELECT is(
    (pg_temp.r('k1_again')).lease_token, NULL,
    'in_progress never reveals the owner''s lease token'
);
SELECT is(
    (pg_temp.r('k1_again')).retry_after, interval '25 seconds',
    'in_progress: retry_after is the time left on the lease'
);
SELECT is(
    (pg_temp.r('k1_again')).lease_expires_at, now() + interval '30 seconds',
    'in_progress: lease_expires_at is the owner''s'
);
SELECT results_eq(
    $$SELECT count(*), min(lease_token), min(attempts)
      FROM idempotency.keys WHERE scope = 'lc' AND key = 'k1'$$,
    $$SELECT 1::bigint, r.lease_token, 1 FROM res AS r WHERE r.tag = 'k1_claim'$$,
    'in_progress changes nothing: one row, same token, attempts 1'
);

-- Equivalent spellings of the request ----------------------------------------------------------

SELECT pg_temp.keep('k1_reordered', idempotency.claim(
    scope => 'lc', key => 'k1',
    request => '{"items": [{"qty": 2.0, "sku": "a-1"}], "currency": "EUR", "amount": 50.0}',
    reference_time => now() + interval '5 seconds'
));

SELECT pg_temp.keep('k1_spaced', idempotency.claim(
    scope => 'lc', key => 'k1',
    request => (
        E'{\n  "currency" : "EUR" ,\t"amount":5e1,\r\n "items" : [ {"sku":"a-1"'
        || E',"qty":2} ] }'
    )::jsonb,
    reference_time => now() + interval '5 seconds'
));

SELECT is(
    (pg_temp.r('k1_reordered')).outcome, 'in_progress',
    'keys reordered and 50.0 for 50: same fingerprint (in_progress, not mismatch)'
);
SELECT is(
    (pg_temp.r('k1_spaced')).outcome, 'in_progress',
    '5e1 for 50 and extra whitespace: same fingerprint (in_progress, not mismatch)'
);
SELECT is(
    idempotency.fingerprint('{"amount": 5e1, "currency": "EUR", "items": [{"qty": 2, "s": "a"}]}'),
    idempotency.fingerprint('{"items":[{"qty":2.00,"s":"a"}],"amount":50.0,"currency":"EUR"}'),
    'fingerprint: 5e1, 50.0 and 50 with reordered keys hash alike'
);
SELECT is(
    pg_temp.n('lc', 'k1'), 1::bigint,
    'equivalent requests never add a row'
);

-- A different request under the same key -------------------------------------------------------

SELECT pg_temp.keep('k1_mismatch', idempotency.claim(
    scope => 'lc', key => 'k1',
    request => '{"amount": 51, "currency": "EUR", "items": [{"sku": "a-1", "qty": 2}]}',
    reference_time => now() + interval '5 seconds'
));

SELECT is(
    (pg_temp.r('k1_mismatch')).outcome, 'mismatch',
    'different request under the same key: mismatch'
);
SELECT results_eq(
    $$SELECT lease_token, response_status, response_body, response_body_bytes, response_headers
      FROM res WHERE tag = 'k1_mismatch'$$,
    $$VALUES (NULL::bigint, NULL::integer, NULL::jsonb, NULL::bytea, NULL::jsonb)$$,
    'mismatch: no lease token, no response'
);
SELECT results_eq(
    $$SELECT count(*), (array_agg(fingerprint))[1], min(lease_token), min(attempts)
      FROM idempotency.keys WHERE scope = 'lc' AND key = 'k1'$$,
    $$SELECT 1::bigint,
             idempotency.fingerprint(
                 '{"amount": 50, "currency": "EUR", "items": [{"sku": "a-1", "qty": 2}]}'),
             r.lease_token, 1
      FROM res AS r WHERE r.tag = 'k1_claim'$$,
    'mismatch changes nothing: same fingerprint, token and attempts'
);
SELECT throws_ok(
    $$SELECT idempotency.claim(
        scope => 'lc', key => 'k1', request => '{"amount": 51}', strict => true,
        reference_time => now() + interval '5 seconds')$$,
    'IK002',
    'idempotency.claim: key "k1" in scope "lc" was used with a different request',
    'strict => true: a mismatch raises IK002'
);
SELECT is(
    (
        SELECT c.outcome
        FROM idempotency.claim(
            scope => 'lc', key => 'k1',
            request => '{"amount": 50, "currency": "EUR", "items": [{"sku": "a-1", "qty": 2}]}',
            strict => true, reference_time => now() + interval '5 seconds'
        ) AS c
    ),
    'in_progress',
    'strict => true with the same request: in_progress, no error'
);

-- checkpoint -----------------------------------------------------------------------------------

SELECT is(
    idempotency.checkpoint(
        scope => 'lc', key => 'k1',
        lease_token => (pg_temp.r('k1_claim')).lease_token,
        recovery_point => 'charged', reference_time => now() + interval '10 seconds'
    ),
    now() + interval '30 seconds',
    'checkpoint without extend: returns the unchanged lease expiry'
);
SELECT results_eq(
    $$SELECT recovery_point, lease_expires_at FROM idempotency.keys
      WHERE scope = 'lc' AND key = 'k1'$$,
    $$VALUES ('charged'::text, now() + interval '30 seconds')$$,
    'checkpoint records the recovery point'
);
SELECT is(
    idempotency.checkpoint(
        scope => 'lc', key => 'k1',
        lease_token => (pg_temp.r('k1_claim')).lease_token,
        recovery_point => 'charged', extend => '2 minutes',
        reference_time => now() + interval '10 seconds'
    ),
    now() + interval '130 seconds',
    'checkpoint with extend: lease extended to reference_time + extend'
);
SELECT is(
    idempotency.checkpoint(
        scope => 'lc', key => 'k1',
        lease_token => (pg_temp.r('k1_claim')).lease_token,
        recovery_point => 'shipped', extend => '1 second',
        reference_time => now() + interval '11 seconds'
    ),
    now() + interval '130 seconds',
    'checkpoint with a short extend never shortens the lease'
);
SELECT results_eq(
    $$SELECT recovery_point, lease_expires_at FROM idempotency.keys
      WHERE scope = 'lc' AND key = 'k1'$$,
    $$VALUES ('shipped'::text, now() + interval '130 seconds')$$,
    'checkpoint: latest recovery point and the extended expiry are stored'
);

SELECT pg_temp.keep('k1_after_checkpoint', idempotency.claim(
    scope => 'lc', key => 'k1',
    request => '{"amount": 50, "currency": "EUR", "items": [{"sku": "a-1", "qty": 2}]}',
    reference_time => now() + interval '20 seconds'
));

SELECT results_eq(
    $$SELECT outcome, recovery_point, retry_after FROM res WHERE tag = 'k1_after_checkpoint'$$,
    $$VALUES ('in_progress'::text, 'shipped'::text, interval '110 seconds')$$,
    'in_progress after checkpoint: the recovery point and the extended retry_after'
);

-- heartbeat ------------------------------------------------------------------------------------

SELECT is(
    idempotency.heartbeat(
        scope => 'lc', key => 'k1',
        lease_token => (pg_temp.r('k1_claim')).lease_token,
        lease => '5 minutes', reference_time => now() + interval '20 seconds'
    ),
    now() + interval '320 seconds',
    'heartbeat: lease extended to reference_time + lease'
);
SELECT is(
    idempotency.heartbeat(
        scope => 'lc', key => 'k1',
        lease_token => (pg_temp.r('k1_claim')).lease_token,
        lease => '1 second', reference_time => now() + interval '21 seconds'
    ),
    now() + interval '320 seconds',
    'heartbeat with a short lease never shortens the lease'
);
SELECT is(
    (pg_temp.k('lc', 'k1')).lease_expires_at,
    now() + interval '320 seconds',
    'heartbeat: the row holds the extended expiry'
);

-- complete and replay --------------------------------------------------------------------------

SELECT is(
    idempotency.complete(
        scope => 'lc', key => 'k1',
        lease_token => (pg_temp.r('k1_claim')).lease_token,
        status => 201, body => '{"id": 42, "amount": 50}',
        headers => '{"Location": "/orders/42", "X-Trace": "t-1"}',
        reference_time => now() + interval '40 seconds'
    ),
    now() + interval '40 seconds',
    'complete returns completed_at = reference_time'
);
SELECT results_eq(
    $$SELECT state, response_status, response_body, response_headers, response_body_bytes,
             response_content_type, completed_at, lease_expires_at, recovery_point, attempts
      FROM idempotency.keys WHERE scope = 'lc' AND key = 'k1'$$,
    $$VALUES ('completed'::text, 201, '{"id": 42, "amount": 50}'::jsonb,
              '{"Location": "/orders/42", "X-Trace": "t-1"}'::jsonb, NULL::bytea,
              'application/json'::text, now() + interval '40 seconds', NULL::timestamptz,
              'shipped'::text, 1)$$,
    'complete stores status, body, headers, content type application/json and completed_at'
);

SELECT pg_temp.keep('k1_replay', idempotency.claim(
    scope => 'lc', key => 'k1',
    request => '{"items": [{"sku": "a-1", "qty": 2}], "currency": "EUR", "amount": 5e1}',
    reference_time => now() + interval '1 hour'
));

SELECT results_eq(
    $$SELECT outcome, lease_token, response_status, response_body, response_headers,
             response_body_bytes, response_content_type, completed_at, created_at,
             recovery_point, attempts, retry_after
      FROM res WHERE tag = 'k1_replay'$$,
    $$VALUES ('replay'::text, NULL::bigint, 201, '{"id": 42, "amount": 50}'::jsonb,
              '{"Location": "/orders/42", "X-Trace": "t-1"}'::jsonb, NULL::bytea,
              'application/json'::text, now() + interval '40 seconds', now(),
              'shipped'::text, 1, NULL::interval)$$,
    'claim after complete: replay with the identical status, body, headers and content type'
);
SELECT is(
    (
        SELECT c.outcome
        FROM idempotency.claim(
            scope => 'lc', key => 'k1', request => '{"amount": 7}',
            reference_time => now() + interval '1 hour'
        ) AS c
    ),
    'mismatch',
    'a different request under a completed key: mismatch, never replay'
);
SELECT is(
    (
        SELECT c.response_body
        FROM idempotency.claim(
            scope => 'lc', key => 'k1', request => '{"amount": 7}',
            reference_time => now() + interval '1 hour'
        ) AS c
    ),
    NULL,
    'mismatch under a completed key carries no response body'
);
SELECT throws_ok(
    $$SELECT idempotency.complete('lc', 'k1',
        (pg_temp.r('k1_claim')).lease_token, 200, '{}')$$,
    'IK004',
    'idempotency.complete: key "k1" in scope "lc" is already completed',
    'complete on a completed key: IK004'
);
SELECT throws_ok(
    $$SELECT idempotency.complete_bytes('lc', 'k1',
        (pg_temp.r('k1_claim')).lease_token, 200, '\x00'::bytea, 'a/b')$$,
    'IK004', NULL,
    'complete_bytes on a completed key: IK004'
);
SELECT throws_ok(
    $$SELECT idempotency.checkpoint('lc', 'k1',
        (pg_temp.r('k1_claim')).lease_token, 'later')$$,
    'IK004', NULL,
    'checkpoint on a completed key: IK004'
);
SELECT throws_ok(
    $$SELECT idempotency.heartbeat('lc', 'k1',
        (pg_temp.r('k1_claim')).lease_token)$$,
    'IK004', NULL,
    'heartbeat on a completed key: IK004'
);
SELECT throws_ok(
    $$SELECT idempotency.release('lc', 'k1',
        (pg_temp.r('k1_claim')).lease_token)$$,
    'IK004', NULL,
    'release on a completed key: IK004'
);
SELECT results_eq(
    $$SELECT count(*), min(state), min(response_status), min(recovery_point)
      FROM idempotency.keys WHERE scope = 'lc' AND key = 'k1'$$,
    $$VALUES (1::bigint, 'completed'::text, 201, 'shipped'::text)$$,
    'the refused calls on a completed key changed nothing'
);

-- complete_bytes -------------------------------------------------------------------------------

SELECT pg_temp.keep('k2_claim', idempotency.claim(
    scope => 'lc', key => 'k2', request => '{"report": "q3"}', reference_time => now()
));

SELECT is(
    idempotency.complete_bytes(
        scope => 'lc', key => 'k2',
        lease_token => (pg_temp.r('k2_claim')).lease_token,
        status => 200, body => '\x255044462d312e370a00ff'::bytea,
        content_type => 'application/pdf',
        headers => '{"Content-Disposition": "attachment; filename=q3.pdf"}',
        reference_time => now() + interval '1 second'
    ),
    now() + interval '1 second',
    'complete_bytes returns completed_at'
);
SELECT results_eq(
    $$SELECT state, response_status, response_body, response_body_bytes, response_content_type,
             response_headers
      FROM idempotency.keys WHERE scope = 'lc' AND key = 'k2'$$,
    $$VALUES ('completed'::text, 200, NULL::jsonb, '\x255044462d312e370a00ff'::bytea,
              'application/pdf'::text,
              '{"Content-Disposition": "attachment; filename=q3.pdf"}'::jsonb)$$,
    'complete_bytes stores the bytes and content type, response_body NULL'
);

SELECT pg_temp.keep('k2_replay', idempotency.claim(
    scope => 'lc', key => 'k2', request => '{"report": "q3"}',
    reference_time => now() + interval '2 seconds'
));

SELECT results_eq(
    $$SELECT outcome, response_status, response_body, response_body_bytes,
             response_content_type, response_headers
      FROM res WHERE tag = 'k2_replay'$$,
    $$VALUES ('replay'::text, 200, NULL::jsonb, '\x255044462d312e370a00ff'::bytea,
              'application/pdf'::text,
              '{"Content-Disposition": "attachment; filename=q3.pdf"}'::jsonb)$$,
    'replay of complete_bytes: the same bytes and content type, response_body NULL'
);

-- complete with no body (204) ------------------------------------------------------------------

SELECT pg_temp.keep('k3_claim', idempotency.claim(
    scope => 'lc', key => 'k3', request => '{"delete": 9}', reference_time => now()
));

SELECT lives_ok(
    $$SELECT idempotency.complete('lc', 'k3',
        (pg_temp.r('k3_claim')).lease_token, 204, NULL,
        reference_time => now() + interval '1 second')$$,
    'complete with a NULL body (204) succeeds'
);
SELECT results_eq(
    $$SELECT state, response_status, response_body, response_body_bytes, response_content_type,
             response_headers
      FROM idempotency.keys WHERE scope = 'lc' AND key = 'k3'$$,
    $$VALUES ('completed'::text, 204, NULL::jsonb, NULL::bytea, NULL::text, '{}'::jsonb)$$,
    'complete with a NULL body: no body, no content type, empty headers'
);

SELECT pg_temp.keep('k3_replay', idempotency.claim(
    scope => 'lc', key => 'k3', request => '{"delete": 9}',
    reference_time => now() + interval '2 seconds'
));

SELECT results_eq(
    $$SELECT outcome, response_status, response_body, response_content_type
      FROM res WHERE tag = 'k3_replay'$$,
    $$VALUES ('replay'::text, 204, NULL::jsonb, NULL::text)$$,
    'replay of a 204: status 204, no body'
);

-- Expired lease: resumed, and the old token is fenced off --------------------------------------

SELECT pg_temp.keep('k4_claim', idempotency.claim(
    scope => 'lc', key => 'k4', request => '{"transfer": 100}', lease => '200 milliseconds',
    reference_time => now()
));

SELECT is(
    idempotency.checkpoint(
        scope => 'lc', key => 'k4',
        lease_token => (pg_temp.r('k4_claim')).lease_token,
        recovery_point => 'debited', reference_time => now() + interval '100 milliseconds'
    ),
    now() + interval '200 milliseconds',
    'checkpoint inside a short lease'
);

SELECT pg_temp.keep('k4_resume', idempotency.claim(
    scope => 'lc', key => 'k4', request => '{"transfer": 100}',
    reference_time => now() + interval '1 second'
));

SELECT is(
    (pg_temp.r('k4_resume')).outcome, 'resumed',
    'claim after the lease expired: resumed'
);
SELECT cmp_ok(
    (pg_temp.r('k4_resume')).lease_token, '>',
    (pg_temp.r('k4_claim')).lease_token,
    'resumed: a higher lease token than the expired one'
);
SELECT results_eq(
    $$SELECT attempts, recovery_point, lease_expires_at, retry_after, created_at
      FROM res WHERE tag = 'k4_resume'$$,
    $$VALUES (2, 'debited'::text, now() + interval '31 seconds', NULL::interval, now())$$,
    'resumed: attempts 2, the recovery point kept, a fresh lease from reference_time'
);
SELECT results_eq(
    $$SELECT count(*), min(lease_token), min(attempts), min(recovery_point), min(state)
      FROM idempotency.keys WHERE scope = 'lc' AND key = 'k4'$$,
    $$SELECT 1::bigint, r.lease_token, 2, 'debited'::text, 'in_progress'::text
      FROM res AS r WHERE r.tag = 'k4_resume'$$,
    'resumed: the one row carries the new token and attempts 2'
);
SELECT throws_ok(
    $$SELECT idempotency.checkpoint('lc', 'k4',
        (pg_temp.r('k4_claim')).lease_token, 'credited',
        reference_time => now() + interval '2 seconds')$$,
    'IK001', NULL,
    'old token after a resume: checkpoint raises IK001'
);
SELECT throws_ok(
    $$SELECT idempotency.heartbeat('lc', 'k4',
        (pg_temp.r('k4_claim')).lease_token,
        reference_time => now() + interval '2 seconds')$$,
    'IK001', NULL,
    'old token after a resume: heartbeat raises IK001'
);
SELECT throws_ok(
    format(
        $$SELECT idempotency.complete('lc', 'k4', %s, 200, '{"stale": true}',
            reference_time => now() + interval '2 seconds')$$,
        (pg_temp.r('k4_claim')).lease_token
    ),
    'IK001',
    format(
        'idempotency.complete: lease token %s is not the current one for key "k4" in scope "lc"',
        (pg_temp.r('k4_claim')).lease_token
    ),
    'old token after a resume: complete raises IK001'
);
SELECT throws_ok(
    $$SELECT idempotency.complete_bytes('lc', 'k4',
        (pg_temp.r('k4_claim')).lease_token, 200, '\x01'::bytea, 'a/b',
        reference_time => now() + interval '2 seconds')$$,
    'IK001', NULL,
    'old token after a resume: complete_bytes raises IK001'
);
SELECT throws_ok(
    $$SELECT idempotency.release('lc', 'k4',
        (pg_temp.r('k4_claim')).lease_token)$$,
    'IK001', NULL,
    'old token after a resume: release raises IK001'
);
SELECT results_eq(
    $$SELECT count(*), min(lease_token), min(recovery_point), min(state),
             min(lease_expires_at), min(response_status)
      FROM idempotency.keys WHERE scope = 'lc' AND key = 'k4'$$,
    $$SELECT 1::bigint, r.lease_token, 'debited'::text, 'in_progress'::text,
             now() + interval '31 seconds', NULL::integer
      FROM res AS r WHERE r.tag = 'k4_resume'$$,
    'the fenced-off calls changed nothing'
);
SELECT lives_ok(
    $$SELECT idempotency.complete('lc', 'k4',
        (pg_temp.r('k4_resume')).lease_token, 200, '{"done": true}',
        reference_time => now() + interval '3 seconds')$$,
    'the new token completes the resumed key'
);
SELECT is(
    (pg_temp.k('lc', 'k4')).response_body,
    '{"done": true}'::jsonb,
    'the resumed holder''s response is stored'
);

-- An expired lease not yet taken over: the token still decides ---------------------------------

SELECT pg_temp.keep('k5_claim', idempotency.claim(
    scope => 'lc', key => 'k5', request => '{}', lease => '200 milliseconds',
    reference_time => now()
));

SELECT is(
    idempotency.heartbeat(
        scope => 'lc', key => 'k5',
        lease_token => (pg_temp.r('k5_claim')).lease_token,
        lease => '30 seconds', reference_time => now() + interval '1 second'
    ),
    now() + interval '31 seconds',
    'heartbeat after expiry but before any takeover renews the lease'
);
SELECT is(
    (
        SELECT c.outcome
        FROM idempotency.claim(
            scope => 'lc', key => 'k5', request => '{}',
            reference_time => now() + interval '2 seconds'
        ) AS c
    ),
    'in_progress',
    'after that heartbeat a retry sees in_progress, not resumed'
);

-- An expired lease claimed with a different request --------------------------------------------

SELECT pg_temp.keep('k8_claim', idempotency.claim(
    scope => 'lc', key => 'k8', request => '{"a": 1}', lease => '1 second',
    reference_time => now()
));

SELECT is(
    (
        SELECT c.outcome
        FROM idempotency.claim(
            scope => 'lc', key => 'k8', request => '{"a": 2}',
            reference_time => now() + interval '1 minute'
        ) AS c
    ),
    'mismatch',
    'expired lease, different request: mismatch, not resumed'
);
SELECT results_eq(
    $$SELECT count(*), min(lease_token), min(attempts)
      FROM idempotency.keys WHERE scope = 'lc' AND key = 'k8'$$,
    $$SELECT 1::bigint, r.lease_token, 1 FROM res AS r WHERE r.tag = 'k8_claim'$$,
    'a mismatch never takes over an expired lease'
);

-- Wrong tokens: IK001 whatever the key's state (no oracle) -------------------------------------

-- A token that is not the key's current one gets IK001, the same for a key never claimed, one
-- in another scope, one in progress under another token, completed by another token, or
-- released: a caller learns nothing about a key it does not own (IK003 is takeover()'s only).
SELECT throws_ok(
    $$SELECT idempotency.checkpoint('lc', 'nope', 1, 'x')$$,
    'IK001',
    'idempotency.checkpoint: lease token 1 is not the current one for key "nope" in scope "lc"',
    'checkpoint on an unknown key: IK001'
);
SELECT throws_ok(
    $$SELECT idempotency.heartbeat('lc', 'nope', 1)$$,
    'IK001', NULL,
    'heartbeat on an unknown key: IK001'
);
SELECT throws_ok(
    $$SELECT idempotency.complete('lc', 'nope', 1, 200, '{}')$$,
    'IK001', NULL,
    'complete on an unknown key: IK001'
);
SELECT throws_ok(
    $$SELECT idempotency.complete_bytes('lc', 'nope', 1, 200, '\x00'::bytea, 'a/b')$$,
    'IK001', NULL,
    'complete_bytes on an unknown key: IK001'
);
SELECT throws_ok(
    $$SELECT idempotency.release('lc', 'nope', 1)$$,
    'IK001',
    'idempotency.release: lease token 1 is not the current one for key "nope" in scope "lc"',
    'release on an unknown key: IK001'
);
SELECT throws_ok(
    $$SELECT idempotency.complete('other-scope', 'k1',
        (pg_temp.r('k1_claim')).lease_token, 200, '{}')$$,
    'IK001', NULL,
    'the same key in another scope is another key: IK001'
);
SELECT is_empty(
    $$SELECT FROM idempotency.keys WHERE key = 'nope' OR scope = 'other-scope'$$,
    'calls on unknown keys wrote nothing'
);

-- k9: released by its owner (and left so: takeover below, and the invariants at the end).
SELECT pg_temp.keep('k9_claim', idempotency.claim(
    scope => 'lc', key => 'k9', request => '{"v": 9}', reference_time => now()
));
SELECT lives_ok(
    $$SELECT idempotency.release('lc', 'k9', (pg_temp.r('k9_claim')).lease_token)$$,
    'release k9'
);

-- Token 1 (nobody's) and k9's released token, on a key in progress (k5), completed (k1),
-- released (k9) and absent (nope): per function and token, one answer once the key's name is
-- taken out of it.
SELECT results_eq(
    $$SELECT f, t, count(*), count(DISTINCT replace(a, '"' || k || '"', '"K"')),
             bool_and(a LIKE 'IK001 | % | % | %')
      FROM (VALUES
          ('accept', $c$SELECT idempotency.accept('lc', %L, %s, 202, '{}')$c$),
          ('checkpoint', $c$SELECT idempotency.checkpoint('lc', %L, %s, 'x')$c$),
          ('complete', $c$SELECT idempotency.complete('lc', %L, %s, 200, '{}')$c$),
          ('complete_bytes',
           $c$SELECT idempotency.complete_bytes('lc', %L, %s, 200, '\x00'::bytea, 'a/b')$c$),
          ('heartbeat', $c$SELECT idempotency.heartbeat('lc', %L, %s)$c$),
          ('release', $c$SELECT idempotency.release('lc', %L, %s)$c$)
      ) AS fns (f, c)
      CROSS JOIN (VALUES ('k5'), ('k1'), ('k9'), ('nope')) AS keys (k)
      CROSS JOIN (VALUES ('1'), ('k9')) AS tokens (t)
      CROSS JOIN LATERAL (
          SELECT pg_temp.answer(format(
              c, k, CASE t WHEN '1' THEN 1 ELSE (pg_temp.r('k9_claim')).lease_token END)) AS a
      ) AS answers
      GROUP BY f, t ORDER BY f, t$$,
    $$SELECT f, t, 4::bigint, 1::bigint, true
      FROM unnest(ARRAY['accept', 'checkpoint', 'complete', 'complete_bytes', 'heartbeat',
                        'release']) AS f
      CROSS JOIN unnest(ARRAY['1', 'k9']) AS t
      ORDER BY f, t$$,
    'no oracle: a wrong token gets one IK001 answer (message, DETAIL, HINT) in every key state'
);
SELECT results_eq(
    $$SELECT state, lease_expires_at, response_status, lease_token
      FROM idempotency.keys WHERE scope = 'lc' AND key IN ('k1', 'k5', 'k9') ORDER BY key$$,
    $$SELECT 'completed'::text, NULL::timestamptz, 201, (pg_temp.r('k1_claim')).lease_token
      UNION ALL
      SELECT 'in_progress', now() + interval '31 seconds', NULL, (pg_temp.r('k5_claim')).lease_token
      UNION ALL
      SELECT 'released', NULL, NULL, (pg_temp.r('k9_claim')).lease_token$$,
    'the refused calls changed none of those keys'
);

-- release --------------------------------------------------------------------------------------

SELECT pg_temp.keep('k6_claim', idempotency.claim(
    scope => 'lc', key => 'k6', request => '{"v": 1}', reference_time => now()
));

SELECT lives_ok(
    $$SELECT idempotency.release('lc', 'k6',
        (pg_temp.r('k6_claim')).lease_token)$$,
    'release by the holder succeeds'
);
SELECT results_eq(
    $$SELECT count(*), min(state), min(lease_token), min(lease_expires_at),
             min(response_status), bool_and(response_body IS NULL AND response_headers IS NULL)
      FROM idempotency.keys WHERE scope = 'lc' AND key = 'k6'$$,
    $$SELECT 1::bigint, 'released'::text, (pg_temp.r('k6_claim')).lease_token,
             NULL::timestamptz, NULL::integer, true$$,
    'release keeps the row, released: the token, no lease, no response'
);
SELECT results_eq(
    $$SELECT d.created_at FROM idempotency.key_directory AS d
      WHERE d.scope = 'lc' AND d.key_hash = sha256('k6'::bytea)$$,
    $$VALUES (now())$$,
    'release keeps the key''s directory row'
);

SELECT pg_temp.keep('k6_reclaim', idempotency.claim(
    scope => 'lc', key => 'k6', request => '{"v": 2}',
    reference_time => now() + interval '1 second'
));

SELECT is(
    (pg_temp.r('k6_reclaim')).outcome, 'claimed',
    'after release, a claim with a different request is claimed'
);
SELECT cmp_ok(
    (pg_temp.r('k6_reclaim')).lease_token, '>',
    (pg_temp.r('k6_claim')).lease_token,
    'the new claim has a higher token'
);
SELECT results_eq(
    $$SELECT count(*), (array_agg(fingerprint))[1], min(attempts), min(recovery_point)
      FROM idempotency.keys WHERE scope = 'lc' AND key = 'k6'$$,
    $$VALUES (1::bigint, idempotency.fingerprint('{"v": 2}'), 1, NULL::text)$$,
    'the new claim starts afresh: new fingerprint, attempts 1, no recovery point'
);
SELECT results_eq(
    $$SELECT k.state, k.created_at, d.created_at
      FROM idempotency.keys AS k
      INNER JOIN idempotency.key_directory AS d
          ON d.scope = k.scope AND d.key_hash = sha256(convert_to(k.key, 'UTF8'))
      WHERE k.scope = 'lc' AND k.key = 'k6'$$,
    $$VALUES ('in_progress'::text, now() + interval '1 second', now() + interval '1 second')$$,
    'the released row is replaced by the new one, and the directory row points at it'
);
SELECT throws_ok(
    $$SELECT idempotency.release('lc', 'k6',
        (pg_temp.r('k6_claim')).lease_token)$$,
    'IK001', NULL,
    'release with the token of the released claim: IK001'
);

-- takeover -------------------------------------------------------------------------------------

SELECT throws_ok(
    $$SELECT idempotency.takeover('lc', 'nope')$$,
    'IK003',
    'idempotency.takeover: key "nope" in scope "lc" does not exist',
    'takeover of an unknown key: IK003'
);
SELECT throws_ok(
    $$SELECT idempotency.takeover('lc', 'k9')$$,
    'IK003',
    'idempotency.takeover: key "k9" in scope "lc" does not exist',
    'takeover of a released key: IK003 (there is no owner to take over from)'
);

SELECT pg_temp.keep('k6_takeover_live', idempotency.takeover(
    scope => 'lc', key => 'k6', reference_time => now() + interval '2 seconds'
));

SELECT results_eq(
    $$SELECT outcome, lease_token, retry_after, attempts FROM res
      WHERE tag = 'k6_takeover_live'$$,
    $$VALUES ('in_progress'::text, NULL::bigint, interval '29 seconds', 1)$$,
    'takeover of a live lease: in_progress with retry_after, no token'
);
SELECT is(
    (pg_temp.k('lc', 'k6')).lease_token,
    (pg_temp.r('k6_reclaim')).lease_token,
    'takeover of a live lease leaves the owner''s token'
);

SELECT pg_temp.keep('k7_claim', idempotency.claim(
    scope => 'lc', key => 'k7', request => '{"job": 7}', lease => '200 milliseconds',
    reference_time => now()
));

SELECT lives_ok(
    $$SELECT idempotency.checkpoint('lc', 'k7',
        (pg_temp.r('k7_claim')).lease_token, 'rp-7',
        reference_time => now())$$,
    'checkpoint k7'
);

SELECT pg_temp.keep('k7_takeover', idempotency.takeover(
    scope => 'lc', key => 'k7', lease => '1 minute',
    reference_time => now() + interval '1 second'
));

SELECT results_eq(
    $$SELECT outcome, attempts, recovery_point, lease_expires_at FROM res
      WHERE tag = 'k7_takeover'$$,
    $$VALUES ('resumed'::text, 2, 'rp-7'::text, now() + interval '61 seconds')$$,
    'takeover of an expired lease (no request needed): resumed, attempts 2, the recovery point'
);
SELECT cmp_ok(
    (pg_temp.r('k7_takeover')).lease_token, '>',
    (pg_temp.r('k7_claim')).lease_token,
    'takeover: a higher token'
);
SELECT results_eq(
    $$SELECT count(*), min(lease_token), min(attempts), min(lease_expires_at)
      FROM idempotency.keys WHERE scope = 'lc' AND key = 'k7'$$,
    $$SELECT 1::bigint, r.lease_token, 2, now() + interval '61 seconds'
      FROM res AS r WHERE r.tag = 'k7_takeover'$$,
    'takeover: the row carries the new token, attempts and expiry'
);
SELECT throws_ok(
    $$SELECT idempotency.complete('lc', 'k7',
        (pg_temp.r('k7_claim')).lease_token, 200, '{}',
        reference_time => now() + interval '2 seconds')$$,
    'IK001', NULL,
    'after takeover the old token cannot complete: IK001'
);

SELECT pg_temp.keep('k1_takeover', idempotency.takeover(
    scope => 'lc', key => 'k1', reference_time => now() + interval '1 hour'
));

SELECT results_eq(
    $$SELECT outcome, lease_token, response_status, response_body, response_headers
      FROM res WHERE tag = 'k1_takeover'$$,
    $$VALUES ('replay'::text, NULL::bigint, 201, '{"id": 42, "amount": 50}'::jsonb,
              '{"Location": "/orders/42", "X-Trace": "t-1"}'::jsonb)$$,
    'takeover of a completed key: replay with the stored response'
);

-- list_abandoned -------------------------------------------------------------------------------

SELECT pg_temp.keep('a1', idempotency.claim(
    scope => 'la', key => 'a1', request => '{}', lease => '1 second', reference_time => now()
));
SELECT pg_temp.keep('a2', idempotency.claim(
    scope => 'la', key => 'a2', request => '{}', lease => '3 seconds', reference_time => now()
));
SELECT pg_temp.keep('a3', idempotency.claim(
    scope => 'la', key => 'a3', request => '{}', lease => '2 seconds', reference_time => now()
));
SELECT pg_temp.keep('a4', idempotency.claim(
    scope => 'la', key => 'a4', request => '{}', lease => '1 minute', reference_time => now()
));
SELECT pg_temp.keep('a5', idempotency.claim(
    scope => 'la', key => 'a5', request => '{}', lease => '1 second', reference_time => now()
));
SELECT pg_temp.keep('b1', idempotency.claim(
    scope => 'lb', key => 'b1', request => '{}', lease => '500 milliseconds',
    reference_time => now()
));

SELECT lives_ok(
    $$SELECT idempotency.complete('la', 'a5', (pg_temp.r('a5')).lease_token,
        200, '{}', reference_time => now())$$,
    'complete a5 (a completed key is never abandoned)'
);
SELECT lives_ok(
    $$SELECT idempotency.checkpoint('la', 'a1', (pg_temp.r('a1')).lease_token,
        'rp-a1', reference_time => now())$$,
    'checkpoint a1'
);

SELECT results_eq(
    $$SELECT key FROM idempotency.list_abandoned(
        scope => 'la', reference_time => now() + interval '10 seconds')$$,
    $$VALUES ('a1'::text), ('a3'), ('a2')$$,
    'list_abandoned: only expired in-progress keys of the scope, oldest expiry first'
);
SELECT results_eq(
    $$SELECT key FROM idempotency.list_abandoned(
        max_keys => 2, scope => 'la', reference_time => now() + interval '10 seconds')$$,
    $$VALUES ('a1'::text), ('a3')$$,
    'list_abandoned respects max_keys'
);
SELECT results_eq(
    $$SELECT scope, key FROM idempotency.list_abandoned(
        reference_time => now() + interval '10 seconds')
      WHERE scope IN ('la', 'lb')$$,
    $$VALUES ('lb'::text, 'b1'::text), ('la', 'a1'), ('la', 'a3'), ('la', 'a2')$$,
    'list_abandoned without a scope lists every scope, oldest expiry first'
);
SELECT results_eq(
    $$SELECT key FROM idempotency.list_abandoned(
        scope => 'la', reference_time => now() + interval '1 second')$$,
    $$VALUES ('a1'::text)$$,
    'list_abandoned: a lease expiring exactly at reference_time is abandoned'
);
SELECT is_empty(
    $$SELECT key FROM idempotency.list_abandoned(
        scope => 'la', reference_time => now() + interval '999 milliseconds')$$,
    'list_abandoned: nothing before the first expiry'
);
SELECT results_eq(
    $$SELECT scope, key, lease_expires_at, recovery_point, attempts, created_at
      FROM idempotency.list_abandoned(
          max_keys => 1, scope => 'la', reference_time => now() + interval '10 seconds')$$,
    $$VALUES ('la'::text, 'a1'::text, now() + interval '1 second', 'rp-a1'::text, 1, now())$$,
    'list_abandoned returns scope, key, expiry, recovery point, attempts and created_at'
);

-- Caller-supplied fingerprint ------------------------------------------------------------------

SELECT pg_temp.keep('fp1_claim', idempotency.claim(
    scope => 'lc', key => 'fp1', request => NULL, fingerprint => sha256('order-1'::bytea),
    reference_time => now()
));

SELECT is(
    (pg_temp.r('fp1_claim')).outcome, 'claimed',
    'a caller fingerprint with request NULL: claimed'
);
SELECT is(
    (pg_temp.k('lc', 'fp1')).fingerprint,
    sha256('order-1'::bytea),
    'the caller fingerprint is stored as given'
);
SELECT is(
    (
        SELECT c.outcome
        FROM idempotency.claim(
            scope => 'lc', key => 'fp1', request => NULL,
            fingerprint => sha256('order-1'::bytea), reference_time => now()
        ) AS c
    ),
    'in_progress',
    'the same caller fingerprint: in_progress'
);
SELECT is(
    (
        SELECT c.outcome
        FROM idempotency.claim(
            scope => 'lc', key => 'fp1', request => NULL,
            fingerprint => sha256('order-2'::bytea), reference_time => now()
        ) AS c
    ),
    'mismatch',
    'a different caller fingerprint: mismatch'
);

SELECT pg_temp.keep('fp2_claim', idempotency.claim(
    scope => 'lc', key => 'fp2', request => '{"a": 1, "b": "x"}', reference_time => now()
));

SELECT is(
    (
        SELECT c.outcome
        FROM idempotency.claim(
            scope => 'lc', key => 'fp2', request => NULL,
            fingerprint => idempotency.fingerprint('{"b": "x", "a": 1.0}'),
            reference_time => now()
        ) AS c
    ),
    'in_progress',
    'a claim by request and one by idempotency.fingerprint(request) are the same request'
);

-- Lease tokens: increasing per key, unordered across keys (docs/design.md "Lease tokens") ----

SELECT pg_temp.keep(
    'tk1',
    idempotency.claim(scope => 'lt', key => 'x', request => '{}', reference_time => now())
);
SELECT pg_temp.keep(
    'tk2',
    idempotency.claim(scope => 'lt', key => 'y', request => '{}', reference_time => now())
);
SELECT pg_temp.keep(
    'tk3',
    idempotency.claim(scope => 'lt', key => 'a', request => '{}', reference_time => now())
);

SELECT is(
    (
        SELECT count(DISTINCT lease_token) FROM res
        WHERE tag IN ('tk1', 'tk2', 'tk3')
    ),
    3::bigint,
    'three new keys get three different tokens (32 random low bits)'
);
-- (The clock part is read by the server when the token is made: between the transaction's
-- start, now(), and this statement's clock_timestamp().)
SELECT is_empty(
    $$SELECT FROM res
      WHERE outcome = 'claimed' AND tag NOT IN ('k6_reclaim')
        AND (lease_token >> 32) NOT BETWEEN
            floor(extract(epoch FROM now()) - 1704067200)::bigint
            AND floor(extract(epoch FROM clock_timestamp()) - 1704067200)::bigint$$,
    'a new key''s token: the high bits are the seconds since 2024-01-01 by the server''s clock'
);
SELECT is(
    (
        SELECT count(*)
        FROM res AS earlier
        INNER JOIN res AS later
            ON
                earlier.seq < later.seq
                AND split_part(earlier.tag, '_', 1) = split_part(later.tag, '_', 1)
        WHERE earlier.lease_token IS NOT NULL AND later.lease_token IS NOT NULL
    ),
    3::bigint,
    'three keys had a second owner: k4 (resumed), k6 (claimed after release), k7 (takeover)'
);
SELECT is_empty(
    $$SELECT FROM res AS earlier INNER JOIN res AS later
          ON earlier.seq < later.seq
         AND split_part(earlier.tag, '_', 1) = split_part(later.tag, '_', 1)
      WHERE (later.lease_token >> 32) < (earlier.lease_token >> 32) + 1$$,
    'every later owner of a key has a token whose high bits exceed the earlier owner''s'
);
SELECT is_empty(
    $$SELECT FROM res WHERE outcome IN ('claimed', 'resumed') AND lease_token IS NULL$$,
    'every claimed or resumed outcome carries a token'
);
SELECT is_empty(
    $$SELECT FROM res
      WHERE outcome IN ('in_progress', 'replay', 'mismatch') AND lease_token IS NOT NULL$$,
    'no in_progress, replay or mismatch outcome carries a token'
);

-- Table invariants (the CHECK constraints keys.sql leaves out on purpose) ----------------------

SELECT is_empty(
    $$SELECT FROM idempotency.keys WHERE octet_length(fingerprint) <> 32$$,
    'invariant: every fingerprint is 32 bytes'
);
SELECT is_empty(
    $$SELECT FROM idempotency.keys
      WHERE NOT coalesce(
          (state = 'in_progress' AND lease_expires_at IS NOT NULL AND completed_at IS NULL
           AND response_status IS NULL)
          OR (state = 'completed' AND response_status IS NOT NULL AND completed_at IS NOT NULL)
          OR (state = 'released' AND lease_expires_at IS NULL AND completed_at IS NULL
              AND response_status IS NULL AND response_body IS NULL),
          false)$$,
    'invariant: in_progress rows have a lease, completed rows a status and completed_at, '
    || 'released rows neither'
);
SELECT is(
    (
        SELECT count(*) FROM idempotency.keys
        WHERE state = 'released'
    ),
    1::bigint,
    'one released row (k9) is among them'
);
SELECT is_empty(
    $$SELECT FROM idempotency.keys
      WHERE response_body IS NOT NULL AND response_body_bytes IS NOT NULL$$,
    'invariant: at most one of response_body and response_body_bytes'
);
SELECT is_empty(
    $$SELECT scope, key FROM idempotency.keys GROUP BY scope, key HAVING count(*) > 1$$,
    'invariant: one row per (scope, key)'
);

SELECT * FROM finish();

ROLLBACK;
