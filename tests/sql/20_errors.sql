-- Invalid arguments: every case raises its documented SQLSTATE (docs/errors.md), the message
-- names the function and the argument, and nothing is written.
--
-- IK005 (REPEATABLE READ / SERIALIZABLE) cannot be tested here: the isolation level can only be
-- set before the first query of a transaction, and this file runs in one READ COMMITTED
-- transaction. 21_isolation_repeatable_read.sql and 22_isolation_serializable.sql test it.
BEGIN;

SELECT plan(144);

-- A live key to aim the fenced functions at, so that they fail on the argument, not on IK003.
CREATE TEMP TABLE live ON COMMIT DROP AS
SELECT c.lease_token
FROM idempotency.claim('e', 'live', '{}', reference_time => now()) AS c;

-- state(): a digest of every row of idempotency.keys and idempotency.inbox.
CREATE FUNCTION pg_temp.state()
RETURNS text
LANGUAGE sql
STABLE
AS $$
    SELECT md5(
        coalesce((SELECT string_agg(k::text, '|' ORDER BY k.scope, k.key)
                  FROM idempotency.keys AS k), '')
        || '#'
        || coalesce((SELECT string_agg(i::text, '|' ORDER BY i.consumer, i.message_id)
                     FROM idempotency.inbox AS i), ''))
$$;

CREATE TEMP TABLE saved ON COMMIT DROP AS
SELECT
    pg_temp.state() AS digest,
    (SELECT count(*) FROM idempotency.keys) AS n_keys;

-- error_field(sql, field): runs sql, which must fail, and returns one diagnostics field of the
-- error: column (the bare argument name), detail or hint.
CREATE FUNCTION pg_temp.error_field(sql text, field text)
RETURNS text
LANGUAGE plpgsql
AS $$
DECLARE
    v_column text;
    v_detail text;
    v_hint text;
BEGIN
    EXECUTE sql;
    RETURN '(no error)';
EXCEPTION WHEN OTHERS THEN
    GET STACKED DIAGNOSTICS v_column = COLUMN_NAME, v_detail = PG_EXCEPTION_DETAIL,
                            v_hint = PG_EXCEPTION_HINT;
    RETURN CASE field WHEN 'column' THEN v_column WHEN 'detail' THEN v_detail ELSE v_hint END;
END;
$$;

-- claim ----------------------------------------------------------------------------------------

SELECT throws_ok(
    $$SELECT idempotency.claim(NULL, 'k', '{}')$$,
    'IK010', 'idempotency.claim: argument "scope" must not be NULL',
    'claim: scope NULL is IK010'
);
SELECT throws_ok(
    $$SELECT idempotency.claim('s', NULL, '{}')$$,
    'IK010', 'idempotency.claim: argument "key" must not be NULL',
    'claim: key NULL is IK010'
);
SELECT throws_ok(
    $$SELECT idempotency.claim('s', 'k', NULL)$$,
    'IK010', 'idempotency.claim: argument "request" must not be NULL',
    'claim: request NULL without a fingerprint is IK010'
);
SELECT throws_ok(
    $$SELECT idempotency.claim('s', 'k', '{}', lease => NULL)$$,
    'IK010', 'idempotency.claim: argument "lease" must not be NULL',
    'claim: lease NULL is IK010'
);
SELECT throws_ok(
    $$SELECT idempotency.claim('', 'k', '{}')$$,
    'IK011', 'idempotency.claim: argument "scope" must not be empty',
    'claim: scope empty is IK011'
);
SELECT throws_ok(
    $$SELECT idempotency.claim('s', '', '{}')$$,
    'IK011', 'idempotency.claim: argument "key" must not be empty',
    'claim: key empty is IK011'
);
SELECT throws_ok(
    $$SELECT idempotency.claim(repeat('s', 256), 'k', '{}')$$,
    'IK012', 'idempotency.claim: argument "scope" must be at most 255 characters long',
    'claim: scope of 256 characters is IK012'
);
SELECT throws_ok(
    $$SELECT idempotency.claim('s', repeat('k', 256), '{}')$$,
    'IK012', 'idempotency.claim: argument "key" must be at most 255 characters long',
    'claim: key of 256 characters is IK012'
);
SELECT throws_ok(
    $$SELECT idempotency.claim('s', repeat('é', 256), '{}')$$,
    'IK012', 'idempotency.claim: argument "key" must be at most 255 characters long',
    'claim: key of 256 two-byte characters is IK012 (the limit counts characters)'
);
SELECT throws_ok(
    $$SELECT idempotency.claim(E's\tx', 'k', '{}')$$,
    'IK013', 'idempotency.claim: argument "scope" must not contain control characters',
    'claim: scope with a tab is IK013'
);
SELECT throws_ok(
    $$SELECT idempotency.claim('s', E'k\nx', '{}')$$,
    'IK013', 'idempotency.claim: argument "key" must not contain control characters',
    'claim: key with a newline is IK013'
);
SELECT throws_ok(
    $$SELECT idempotency.claim('s', E'k\x7f', '{}')$$,
    'IK013', 'idempotency.claim: argument "key" must not contain control characters',
    'claim: key with U+007F is IK013'
);
SELECT throws_ok(
    $$SELECT idempotency.claim('s', E'\x01k', '{}')$$,
    'IK013', 'idempotency.claim: argument "key" must not contain control characters',
    'claim: key with U+0001 is IK013'
);
SELECT throws_ok(
    $$SELECT idempotency.claim('s', 'k', '{}', lease => '0 seconds')$$,
    'IK014', 'idempotency.claim: argument "lease" must be greater than 0 and at most 1 day',
    'claim: lease 0 is IK014'
);
SELECT throws_ok(
    $$SELECT idempotency.claim('s', 'k', '{}', lease => '-1 second')$$,
    'IK014', 'idempotency.claim: argument "lease" must be greater than 0 and at most 1 day',
    'claim: a negative lease is IK014'
);
SELECT throws_ok(
    $$SELECT idempotency.claim('s', 'k', '{}', lease => '1 day 1 second')$$,
    'IK014', 'idempotency.claim: argument "lease" must be greater than 0 and at most 1 day',
    'claim: a lease over 1 day is IK014'
);
SELECT throws_ok(
    $$SELECT idempotency.claim('s', 'k', '{}', lease => '25 hours')$$,
    'IK014', 'idempotency.claim: argument "lease" must be greater than 0 and at most 1 day',
    'claim: a lease of 25 hours is IK014'
);
SELECT throws_ok(
    $$SELECT idempotency.claim('s', 'k', '{}', lease => '1 month')$$,
    'IK014', 'idempotency.claim: argument "lease" must be greater than 0 and at most 1 day',
    'claim: a lease of 1 month is IK014'
);
SELECT throws_ok(
    $$SELECT idempotency.claim('s', 'k', NULL, fingerprint => '\x00'::bytea || sha256('x'))$$,
    'IK014', 'idempotency.claim: argument "fingerprint" must be 32 bytes (a sha256)',
    'claim: a fingerprint of 33 bytes is IK014'
);
SELECT throws_ok(
    $$SELECT idempotency.claim('s', 'k', NULL, fingerprint => substr(sha256('x'), 1, 31))$$,
    'IK014', 'idempotency.claim: argument "fingerprint" must be 32 bytes (a sha256)',
    'claim: a fingerprint of 31 bytes is IK014'
);
SELECT throws_ok(
    $$SELECT idempotency.claim('s', 'k', NULL, fingerprint => ''::bytea)$$,
    'IK014', 'idempotency.claim: argument "fingerprint" must be 32 bytes (a sha256)',
    'claim: an empty fingerprint is IK014'
);
SELECT throws_ok(
    $$SELECT idempotency.claim('s', 'k', '{}', fingerprint => sha256('x'))$$,
    'IK016', 'idempotency.claim: argument "fingerprint" must be NULL when request is given',
    'claim: both request and fingerprint is IK016'
);
SELECT throws_ok(
    $$SELECT idempotency.claim('s', 'k', 'null'::jsonb, fingerprint => sha256('x'))$$,
    'IK016', NULL,
    'claim: a JSON null request is a request: with a fingerprint it is IK016'
);
SELECT is(
    pg_temp.error_field($$SELECT idempotency.claim('s', 'k', '{}', lease => '0')$$, 'column'),
    'lease',
    'claim: the error''s COLUMN field is the bare argument name'
);
SELECT is(
    pg_temp.error_field($$SELECT idempotency.claim('s', repeat('k', 256), '{}')$$, 'detail'),
    'It is 256 characters long.',
    'claim: the IK012 detail gives the length'
);
SELECT is(
    pg_temp.error_field($$SELECT idempotency.claim('s', E'ab\tc', '{}')$$, 'detail'),
    'Found "\t" at character 3.',
    'claim: the IK013 detail shows the character and its position'
);
SELECT is(
    pg_temp.error_field($$SELECT idempotency.claim('', 'k', '{}')$$, 'hint'),
    'Nothing was written. See docs/errors.md for this SQLSTATE.',
    'claim: argument errors carry the hint'
);
SELECT is(
    pg_temp.state(), (SELECT digest FROM saved),
    'claim: the refused calls wrote nothing'
);

-- checkpoint -----------------------------------------------------------------------------------

SELECT throws_ok(
    $$SELECT idempotency.checkpoint(NULL, 'live', (SELECT lease_token FROM live), 'rp')$$,
    'IK010', 'idempotency.checkpoint: argument "scope" must not be NULL',
    'checkpoint: scope NULL is IK010'
);
SELECT throws_ok(
    $$SELECT idempotency.checkpoint('e', NULL, (SELECT lease_token FROM live), 'rp')$$,
    'IK010', 'idempotency.checkpoint: argument "key" must not be NULL',
    'checkpoint: key NULL is IK010'
);
SELECT throws_ok(
    $$SELECT idempotency.checkpoint('e', 'live', NULL, 'rp')$$,
    'IK010', 'idempotency.checkpoint: argument "lease_token" must not be NULL',
    'checkpoint: lease_token NULL is IK010'
);
SELECT throws_ok(
    $$SELECT idempotency.checkpoint('e', 'live', (SELECT lease_token FROM live), NULL)$$,
    'IK010', 'idempotency.checkpoint: argument "recovery_point" must not be NULL',
    'checkpoint: recovery_point NULL is IK010'
);
SELECT throws_ok(
    $$SELECT idempotency.checkpoint('e', 'live', (SELECT lease_token FROM live), '')$$,
    'IK011', 'idempotency.checkpoint: argument "recovery_point" must not be empty',
    'checkpoint: recovery_point empty is IK011'
);
SELECT throws_ok(
    $$SELECT idempotency.checkpoint('e', 'live', (SELECT lease_token FROM live),
                                    repeat('r', 256))$$,
    'IK012',
    'idempotency.checkpoint: argument "recovery_point" must be at most 255 characters long',
    'checkpoint: recovery_point of 256 characters is IK012'
);
SELECT throws_ok(
    $$SELECT idempotency.checkpoint('e', 'live', (SELECT lease_token FROM live), E'r\n')$$,
    'IK013',
    'idempotency.checkpoint: argument "recovery_point" must not contain control characters',
    'checkpoint: recovery_point with a newline is IK013'
);
SELECT throws_ok(
    $$SELECT idempotency.checkpoint('', 'live', (SELECT lease_token FROM live), 'rp')$$,
    'IK011', 'idempotency.checkpoint: argument "scope" must not be empty',
    'checkpoint: scope empty is IK011'
);
SELECT throws_ok(
    $$SELECT idempotency.checkpoint('e', E'live\t', (SELECT lease_token FROM live), 'rp')$$,
    'IK013', 'idempotency.checkpoint: argument "key" must not contain control characters',
    'checkpoint: key with a tab is IK013'
);
SELECT throws_ok(
    $$SELECT idempotency.checkpoint('e', 'live', (SELECT lease_token FROM live), 'rp',
                                    extend => '0 seconds')$$,
    'IK014', 'idempotency.checkpoint: argument "extend" must be greater than 0 and at most 1 day',
    'checkpoint: extend 0 is IK014'
);
SELECT throws_ok(
    $$SELECT idempotency.checkpoint('e', 'live', (SELECT lease_token FROM live), 'rp',
                                    extend => '2 days')$$,
    'IK014', 'idempotency.checkpoint: argument "extend" must be greater than 0 and at most 1 day',
    'checkpoint: extend 2 days is IK014'
);
SELECT is(
    pg_temp.state(), (SELECT digest FROM saved),
    'checkpoint: the refused calls wrote nothing'
);

-- heartbeat ------------------------------------------------------------------------------------

SELECT throws_ok(
    $$SELECT idempotency.heartbeat(NULL, 'live', (SELECT lease_token FROM live))$$,
    'IK010', 'idempotency.heartbeat: argument "scope" must not be NULL',
    'heartbeat: scope NULL is IK010'
);
SELECT throws_ok(
    $$SELECT idempotency.heartbeat('e', '', (SELECT lease_token FROM live))$$,
    'IK011', 'idempotency.heartbeat: argument "key" must not be empty',
    'heartbeat: key empty is IK011'
);
SELECT throws_ok(
    $$SELECT idempotency.heartbeat('e', 'live', NULL)$$,
    'IK010', 'idempotency.heartbeat: argument "lease_token" must not be NULL',
    'heartbeat: lease_token NULL is IK010'
);
SELECT throws_ok(
    $$SELECT idempotency.heartbeat('e', 'live', (SELECT lease_token FROM live), NULL)$$,
    'IK010', 'idempotency.heartbeat: argument "lease" must not be NULL',
    'heartbeat: lease NULL is IK010'
);
SELECT throws_ok(
    $$SELECT idempotency.heartbeat('e', 'live', (SELECT lease_token FROM live), '0')$$,
    'IK014', 'idempotency.heartbeat: argument "lease" must be greater than 0 and at most 1 day',
    'heartbeat: lease 0 is IK014'
);
SELECT throws_ok(
    $$SELECT idempotency.heartbeat('e', 'live', (SELECT lease_token FROM live), '1 month')$$,
    'IK014', 'idempotency.heartbeat: argument "lease" must be greater than 0 and at most 1 day',
    'heartbeat: lease 1 month is IK014'
);
SELECT is(
    pg_temp.state(), (SELECT digest FROM saved),
    'heartbeat: the refused calls wrote nothing'
);

-- complete -------------------------------------------------------------------------------------

SELECT throws_ok(
    $$SELECT idempotency.complete(NULL, 'live', (SELECT lease_token FROM live), 200, '{}')$$,
    'IK010', 'idempotency.complete: argument "scope" must not be NULL',
    'complete: scope NULL is IK010'
);
SELECT throws_ok(
    $$SELECT idempotency.complete('e', NULL, (SELECT lease_token FROM live), 200, '{}')$$,
    'IK010', 'idempotency.complete: argument "key" must not be NULL',
    'complete: key NULL is IK010'
);
SELECT throws_ok(
    $$SELECT idempotency.complete('e', 'live', NULL, 200, '{}')$$,
    'IK010', 'idempotency.complete: argument "lease_token" must not be NULL',
    'complete: lease_token NULL is IK010'
);
-- The form of the scope and the key is tested when no key matched (complete's common path
-- leaves it out): the same errors, and the documented order with another bad argument.
SELECT throws_ok(
    $$SELECT idempotency.complete('', 'live', (SELECT lease_token FROM live), 200, '{}')$$,
    'IK011', 'idempotency.complete: argument "scope" must not be empty',
    'complete: scope empty is IK011'
);
SELECT throws_ok(
    $$SELECT idempotency.complete('e', repeat('k', 256), (SELECT lease_token FROM live), 200,
                                  '{}')$$,
    'IK012', 'idempotency.complete: argument "key" must be at most 255 characters long',
    'complete: key of 256 characters is IK012'
);
SELECT throws_ok(
    $$SELECT idempotency.complete('e', E'live\n', (SELECT lease_token FROM live), 200, '{}')$$,
    'IK013', 'idempotency.complete: argument "key" must not contain control characters',
    'complete: key with a newline is IK013'
);
SELECT throws_ok(
    $$SELECT idempotency.complete(E'e\t', 'live', (SELECT lease_token FROM live), 600, '{}')$$,
    'IK013', 'idempotency.complete: argument "scope" must not contain control characters',
    'complete: a bad scope comes before a bad status'
);
SELECT throws_ok(
    $$SELECT idempotency.complete('e', 'live', (SELECT lease_token FROM live) + 1, 200, '{}')$$,
    'IK001', NULL,
    'complete: valid arguments with another token are IK001'
);
SELECT throws_ok(
    $$SELECT idempotency.complete('e', 'live', (SELECT lease_token FROM live), 99, '{}')$$,
    'IK014', 'idempotency.complete: argument "status" must be an HTTP status code (100 to 599)',
    'complete: status 99 is IK014'
);
SELECT throws_ok(
    $$SELECT idempotency.complete('e', 'live', (SELECT lease_token FROM live), 600, '{}')$$,
    'IK014', 'idempotency.complete: argument "status" must be an HTTP status code (100 to 599)',
    'complete: status 600 is IK014'
);
SELECT throws_ok(
    $$SELECT idempotency.complete('e', 'live', (SELECT lease_token FROM live), 200, '{}',
                                  headers => '[["Location", "/x"]]')$$,
    'IK015',
    'idempotency.complete: argument "headers" must be a JSON object of header names to string '
    || 'values',
    'complete: headers as an array is IK015'
);
SELECT throws_ok(
    $$SELECT idempotency.complete('e', 'live', (SELECT lease_token FROM live), 200, '{}',
                                  headers => '{"Retry-After": 5}')$$,
    'IK015', NULL,
    'complete: a header value that is a number is IK015'
);
SELECT throws_ok(
    $$SELECT idempotency.complete('e', 'live', (SELECT lease_token FROM live), 200, '{}',
                                  headers => '{"X-A": ["a", "b"]}')$$,
    'IK015', NULL,
    'complete: a header value that is an array of strings is IK015'
);
SELECT throws_ok(
    $$SELECT idempotency.complete('e', 'live', (SELECT lease_token FROM live), 200, '{}',
                                  headers => '{"X-A": null}')$$,
    'IK015', NULL,
    'complete: a header value that is JSON null is IK015'
);
SELECT throws_ok(
    $$SELECT idempotency.complete('e', 'live', (SELECT lease_token FROM live), 200, '{}',
                                  headers => '{"X-A: evil": "v"}')$$,
    'IK015', NULL,
    'complete: a header name with a colon is IK015'
);
SELECT throws_ok(
    $$SELECT idempotency.complete('e', 'live', (SELECT lease_token FROM live), 200, '{}',
                                  headers => jsonb_build_object('X-A', E'v\r\nSet-Cookie: x'))$$,
    'IK015', NULL,
    'complete: a header value with CR LF (header injection on replay) is IK015'
);
SELECT throws_ok(
    $$SELECT idempotency.complete('e', 'live', (SELECT lease_token FROM live), 200, '{}',
                                  headers => '{"X A": "v"}')$$,
    'IK015', NULL,
    'complete: a header name with a space is IK015'
);
SELECT throws_ok(
    $$SELECT idempotency.complete('e', 'live', (SELECT lease_token FROM live), 200, '{}',
                                  headers => '{"X-A\r\nSet-Cookie": "v"}')$$,
    'IK015', NULL,
    'complete: a header name with CR LF is IK015'
);
SELECT throws_ok(
    $$SELECT idempotency.complete('e', 'live', (SELECT lease_token FROM live), 200, '{}',
                                  headers => '{"": "v"}')$$,
    'IK015', NULL,
    'complete: an empty header name is IK015'
);
SELECT throws_ok(
    $$SELECT idempotency.complete('e', 'live', (SELECT lease_token FROM live), 200, '{}',
                                  headers => 'null'::jsonb)$$,
    'IK015', NULL,
    'complete: headers that are JSON null are IK015'
);
SELECT is(
    pg_temp.error_field(
        $$SELECT idempotency.complete('e', 'live', (SELECT lease_token FROM live), 200, '{}',
                                      headers => '{"Ok": "1", "Bad": 2}')$$,
        'detail'
    ),
    'Header "Bad" has an invalid name, or a value that is not a string or holds control '
    || 'characters.',
    'complete: the IK015 detail names the bad header'
);
SELECT is(
    pg_temp.state(), (SELECT digest FROM saved),
    'complete: the refused calls wrote nothing (the key is still in progress)'
);

-- complete_bytes -------------------------------------------------------------------------------

SELECT throws_ok(
    $$SELECT idempotency.complete_bytes('e', 'live', (SELECT lease_token FROM live), 200,
                                        '\x01'::bytea, NULL)$$,
    'IK010', 'idempotency.complete_bytes: argument "content_type" must not be NULL',
    'complete_bytes: content_type NULL with a body is IK010'
);
SELECT throws_ok(
    $$SELECT idempotency.complete_bytes('e', 'live', (SELECT lease_token FROM live), 200,
                                        '\x01'::bytea, '')$$,
    'IK011', 'idempotency.complete_bytes: argument "content_type" must not be empty',
    'complete_bytes: content_type empty is IK011'
);
SELECT throws_ok(
    $$SELECT idempotency.complete_bytes('e', 'live', (SELECT lease_token FROM live), 200,
                                        '\x01'::bytea, E'text/plain\r\nX: y')$$,
    'IK013', 'idempotency.complete_bytes: argument "content_type" must not contain control '
    || 'characters',
    'complete_bytes: content_type with CR LF is IK013'
);
SELECT throws_ok(
    $$SELECT idempotency.complete_bytes('e', 'live', (SELECT lease_token FROM live), 600,
                                        '\x01'::bytea, 'a/b')$$,
    'IK014', NULL,
    'complete_bytes: status 600 is IK014'
);
SELECT throws_ok(
    $$SELECT idempotency.complete_bytes('e', '', (SELECT lease_token FROM live), 200,
                                        '\x01'::bytea, 'a/b')$$,
    'IK011', 'idempotency.complete_bytes: argument "key" must not be empty',
    'complete_bytes: key empty is IK011'
);
SELECT throws_ok(
    $$SELECT idempotency.complete_bytes(E'e\t', 'live', (SELECT lease_token FROM live), 200,
                                        '\x01'::bytea, 'a/b')$$,
    'IK013', 'idempotency.complete_bytes: argument "scope" must not contain control characters',
    'complete_bytes: scope with a tab is IK013'
);
SELECT throws_ok(
    $$SELECT idempotency.complete_bytes(E'e\t', 'live', (SELECT lease_token FROM live), 200,
                                        '\x01'::bytea, '')$$,
    'IK011', 'idempotency.complete_bytes: argument "content_type" must not be empty',
    'complete_bytes: a bad content type comes before a bad scope'
);
SELECT throws_ok(
    $$SELECT idempotency.complete_bytes('e', 'live', NULL, 200, '\x01'::bytea, 'a/b')$$,
    'IK010', 'idempotency.complete_bytes: argument "lease_token" must not be NULL',
    'complete_bytes: lease_token NULL is IK010'
);
SELECT throws_ok(
    $$SELECT idempotency.complete_bytes('e', 'live', (SELECT lease_token FROM live), 200,
                                        '\x01'::bytea, 'a/b', headers => '["x"]')$$,
    'IK015', 'idempotency.complete_bytes: argument "headers" must be a JSON object of header '
    || 'names to string values',
    'complete_bytes: headers as an array is IK015'
);
SELECT is(
    pg_temp.state(), (SELECT digest FROM saved),
    'complete_bytes: the refused calls wrote nothing'
);

-- release --------------------------------------------------------------------------------------

SELECT throws_ok(
    $$SELECT idempotency.release(NULL, 'live', (SELECT lease_token FROM live))$$,
    'IK010', 'idempotency.release: argument "scope" must not be NULL',
    'release: scope NULL is IK010'
);
SELECT throws_ok(
    $$SELECT idempotency.release('e', '', (SELECT lease_token FROM live))$$,
    'IK011', 'idempotency.release: argument "key" must not be empty',
    'release: key empty is IK011'
);
SELECT throws_ok(
    $$SELECT idempotency.release('e', 'live', NULL)$$,
    'IK010', 'idempotency.release: argument "lease_token" must not be NULL',
    'release: lease_token NULL is IK010'
);
SELECT is(
    pg_temp.state(), (SELECT digest FROM saved),
    'release: the refused calls wrote nothing (the key is still there)'
);

-- takeover -------------------------------------------------------------------------------------

SELECT throws_ok(
    $$SELECT idempotency.takeover(NULL, 'live')$$,
    'IK010', 'idempotency.takeover: argument "scope" must not be NULL',
    'takeover: scope NULL is IK010'
);
SELECT throws_ok(
    $$SELECT idempotency.takeover('e', repeat('k', 256))$$,
    'IK012', 'idempotency.takeover: argument "key" must be at most 255 characters long',
    'takeover: key of 256 characters is IK012'
);
SELECT throws_ok(
    $$SELECT idempotency.takeover('e', 'live', lease => NULL)$$,
    'IK010', 'idempotency.takeover: argument "lease" must not be NULL',
    'takeover: lease NULL is IK010'
);
SELECT throws_ok(
    $$SELECT idempotency.takeover('e', 'live', lease => '0')$$,
    'IK014', 'idempotency.takeover: argument "lease" must be greater than 0 and at most 1 day',
    'takeover: lease 0 is IK014'
);
SELECT throws_ok(
    $$SELECT idempotency.takeover('e', 'live', '2 days',
                                  reference_time => now() + interval '1 hour')$$,
    'IK014', NULL,
    'takeover: an invalid lease is refused before an expired key is taken over'
);

-- list_abandoned -------------------------------------------------------------------------------

SELECT throws_ok(
    $$SELECT * FROM idempotency.list_abandoned(max_keys => NULL)$$,
    'IK010', 'idempotency.list_abandoned: argument "max_keys" must not be NULL',
    'list_abandoned: max_keys NULL is IK010'
);
SELECT throws_ok(
    $$SELECT * FROM idempotency.list_abandoned(max_keys => 0)$$,
    'IK014', 'idempotency.list_abandoned: argument "max_keys" must be between 1 and 10000',
    'list_abandoned: max_keys 0 is IK014'
);
SELECT throws_ok(
    $$SELECT * FROM idempotency.list_abandoned(max_keys => 10001)$$,
    'IK014', 'idempotency.list_abandoned: argument "max_keys" must be between 1 and 10000',
    'list_abandoned: max_keys 10001 is IK014'
);
SELECT throws_ok(
    $$SELECT * FROM idempotency.list_abandoned(max_keys => -1)$$,
    'IK014', NULL,
    'list_abandoned: max_keys -1 is IK014'
);
SELECT throws_ok(
    $$SELECT * FROM idempotency.list_abandoned(scope => '')$$,
    'IK011', 'idempotency.list_abandoned: argument "scope" must not be empty',
    'list_abandoned: scope empty is IK011'
);
SELECT throws_ok(
    $$SELECT * FROM idempotency.list_abandoned(scope => E'e\t')$$,
    'IK013', NULL,
    'list_abandoned: scope with a tab is IK013'
);
SELECT is(
    pg_temp.state(), (SELECT digest FROM saved),
    'takeover and list_abandoned: the refused calls wrote nothing'
);

-- inbox_accept ---------------------------------------------------------------------------------

SELECT throws_ok(
    $$SELECT idempotency.inbox_accept(NULL, 'm')$$,
    'IK010', 'idempotency.inbox_accept: argument "consumer" must not be NULL',
    'inbox_accept: consumer NULL is IK010'
);
SELECT throws_ok(
    $$SELECT idempotency.inbox_accept('c', NULL)$$,
    'IK010', 'idempotency.inbox_accept: argument "message_id" must not be NULL',
    'inbox_accept: message_id NULL is IK010'
);
SELECT throws_ok(
    $$SELECT idempotency.inbox_accept('', 'm')$$,
    'IK011', 'idempotency.inbox_accept: argument "consumer" must not be empty',
    'inbox_accept: consumer empty is IK011'
);
SELECT throws_ok(
    $$SELECT idempotency.inbox_accept('c', '')$$,
    'IK011', 'idempotency.inbox_accept: argument "message_id" must not be empty',
    'inbox_accept: message_id empty is IK011'
);
SELECT throws_ok(
    $$SELECT idempotency.inbox_accept('c', repeat('m', 256))$$,
    'IK012', 'idempotency.inbox_accept: argument "message_id" must be at most 255 characters long',
    'inbox_accept: message_id of 256 characters is IK012'
);
SELECT throws_ok(
    $$SELECT idempotency.inbox_accept(repeat('c', 256), 'm')$$,
    'IK012', NULL,
    'inbox_accept: consumer of 256 characters is IK012'
);
SELECT throws_ok(
    $$SELECT idempotency.inbox_accept(E'c\x7f', 'm')$$,
    'IK013', 'idempotency.inbox_accept: argument "consumer" must not contain control characters',
    'inbox_accept: consumer with U+007F is IK013'
);
SELECT throws_ok(
    $$SELECT idempotency.inbox_accept('c', E'm\n')$$,
    'IK013', NULL,
    'inbox_accept: message_id with a newline is IK013'
);
SELECT is(
    pg_temp.state(), (SELECT digest FROM saved),
    'inbox_accept: the refused calls wrote nothing'
);

-- fingerprint ----------------------------------------------------------------------------------

SELECT throws_ok(
    $$SELECT idempotency.fingerprint(NULL)$$,
    'IK010', 'idempotency.fingerprint: argument "request" must not be NULL',
    'fingerprint: request NULL is IK010'
);
SELECT throws_ok(
    $$SELECT idempotency.fingerprint('{"a": 1}', fields => ARRAY['a', NULL])$$,
    'IK010', 'idempotency.fingerprint: argument "fields" must not contain NULL',
    'fingerprint: fields containing NULL is IK010'
);
SELECT throws_ok(
    $$SELECT idempotency.fingerprint('{"a": 1}', defaults => '[1]')$$,
    'IK015', 'idempotency.fingerprint: argument "defaults" must be a JSON object',
    'fingerprint: defaults as an array is IK015'
);
SELECT throws_ok(
    $$SELECT idempotency.fingerprint('{"a": 1}', defaults => '"x"')$$,
    'IK015', 'idempotency.fingerprint: argument "defaults" must be a JSON object',
    'fingerprint: defaults as a string is IK015'
);
SELECT throws_ok(
    $$SELECT idempotency.fingerprint('{"a": 1}', defaults => 'null'::jsonb)$$,
    'IK015', 'idempotency.fingerprint: argument "defaults" must be a JSON object',
    'fingerprint: defaults as JSON null is IK015'
);
SELECT throws_ok(
    $$SELECT idempotency.fingerprint('[1, 2]', fields => ARRAY['a'])$$,
    'IK015',
    'idempotency.fingerprint: argument "request" must be a JSON object when defaults or fields '
    || 'are given',
    'fingerprint: request not an object when fields are given is IK015'
);
SELECT throws_ok(
    $$SELECT idempotency.fingerprint('"x"', defaults => '{"a": 1}')$$,
    'IK015', NULL,
    'fingerprint: request not an object when defaults are given is IK015'
);
SELECT lives_ok(
    $$SELECT idempotency.fingerprint('[1, 2]')$$,
    'fingerprint: any JSON request is fine without defaults or fields'
);
SELECT lives_ok(
    $$SELECT idempotency.fingerprint('[1, 2]', defaults => '{}')$$,
    'fingerprint: empty defaults do not require an object request'
);
SELECT is(
    pg_temp.error_field($$SELECT idempotency.fingerprint('{}', defaults => '[]')$$, 'column'),
    'defaults',
    'fingerprint: the error''s COLUMN field is the bare argument name'
);

-- derive_key -----------------------------------------------------------------------------------

SELECT throws_ok(
    $$SELECT idempotency.derive_key(NULL, 'k', 'step')$$,
    'IK010', 'idempotency.derive_key: argument "scope" must not be NULL',
    'derive_key: scope NULL is IK010'
);
SELECT throws_ok(
    $$SELECT idempotency.derive_key('s', NULL, 'step')$$,
    'IK010', 'idempotency.derive_key: argument "key" must not be NULL',
    'derive_key: key NULL is IK010'
);
SELECT throws_ok(
    $$SELECT idempotency.derive_key('s', 'k', NULL)$$,
    'IK010', 'idempotency.derive_key: argument "step" must not be NULL',
    'derive_key: step NULL is IK010'
);
SELECT throws_ok(
    $$SELECT idempotency.derive_key('s', 'k', '')$$,
    'IK011', 'idempotency.derive_key: argument "step" must not be empty',
    'derive_key: step empty is IK011'
);
SELECT throws_ok(
    $$SELECT idempotency.derive_key('s', 'k', repeat('x', 256))$$,
    'IK012', 'idempotency.derive_key: argument "step" must be at most 255 characters long',
    'derive_key: step of 256 characters is IK012'
);
SELECT throws_ok(
    $$SELECT idempotency.derive_key('s', E'k\n', 'step')$$,
    'IK013', 'idempotency.derive_key: argument "key" must not contain control characters',
    'derive_key: key with a newline is IK013'
);

-- grant_usage ----------------------------------------------------------------------------------

SELECT throws_ok(
    $$SELECT idempotency.grant_usage(NULL)$$,
    'IK010', 'idempotency.grant_usage: argument "grantee" must not be NULL',
    'grant_usage: grantee NULL is IK010'
);
SELECT throws_ok(
    $$SELECT idempotency.grant_usage(current_user::regrole, kind => NULL)$$,
    'IK010', 'idempotency.grant_usage: argument "kind" must not be NULL',
    'grant_usage: kind NULL is IK010'
);
SELECT throws_ok(
    $$SELECT idempotency.grant_usage(current_user::regrole, kind => 'admin')$$,
    'IK014',
    'idempotency.grant_usage: argument "kind" must be ''request'', ''completer'', ''monitor'' or '
    || '''maintainer''',
    'grant_usage: an unknown kind is IK014'
);

SELECT throws_ok(
    $$SELECT idempotency.claim('s', E'k\u0085', '{}')$$,
    'IK013', 'idempotency.claim: argument "key" must not contain control characters',
    'claim: a key with U+0085 (a C1 control character, NEL) is IK013'
);

-- Nothing was written by any refused call -----------------------------------------------------

SELECT is(
    pg_temp.state(), (SELECT digest FROM saved),
    'no refused call wrote anything to idempotency.keys or idempotency.inbox'
);
SELECT results_eq(
    $$SELECT state, recovery_point, attempts, response_status
      FROM idempotency.keys WHERE scope = 'e' AND key = 'live'$$,
    $$VALUES ('in_progress'::text, NULL::text, 1, NULL::integer)$$,
    'the live key is untouched: in progress, no recovery point, no response'
);

-- The limits themselves are accepted ----------------------------------------------------------

SELECT is(
    (idempotency.claim(repeat('s', 255), repeat('k', 255), '{}')).outcome,
    'claimed',
    'claim: scope and key of exactly 255 characters are accepted'
);
SELECT is(
    (idempotency.claim('s', repeat('é', 255), '{}')).outcome,
    'claimed',
    'claim: a key of 255 two-byte characters is accepted'
);
SELECT is(
    (idempotency.claim('s', 'one-day', '{}', lease => '1 day')).outcome,
    'claimed',
    'claim: a lease of exactly 1 day is accepted'
);
SELECT is(
    (idempotency.claim('s', 'one-microsecond', '{}', lease => '1 microsecond')).outcome,
    'claimed',
    'claim: a lease of 1 microsecond is accepted'
);
SELECT is(
    (idempotency.claim('s', 'unicode-ü-€-😀', '{}')).outcome,
    'claimed',
    'claim: non-ASCII characters are not control characters'
);
SELECT lives_ok(
    $$SELECT idempotency.complete('s', 'one-day',
        (SELECT lease_token FROM idempotency.keys WHERE scope = 's' AND key = 'one-day'), 100,
        NULL)$$,
    'complete: status 100 is accepted'
);
SELECT lives_ok(
    $$SELECT idempotency.complete('s', 'one-microsecond',
        (SELECT lease_token FROM idempotency.keys
         WHERE scope = 's' AND key = 'one-microsecond'), 599, '{}',
        headers => '{"X-Ok": "", "Content-Language": "de-DE, en"}')$$,
    'complete: status 599 and header values with spaces or empty are accepted'
);
SELECT is(
    (SELECT count(*) FROM idempotency.list_abandoned(max_keys => 10000)),
    0::bigint,
    'list_abandoned: max_keys 10000 is accepted'
);
SELECT is(
    (SELECT count(*) FROM idempotency.list_abandoned(max_keys => 1)),
    0::bigint,
    'list_abandoned: max_keys 1 is accepted'
);
SELECT is(
    (SELECT count(*) FROM idempotency.keys) - (SELECT n_keys FROM saved),
    5::bigint,
    'the accepted calls wrote their five keys'
);

-- Last, on keys of their own so that a failure here cannot disturb the tests above:
-- status NULL must not slip past the fast path of _finish, and a content type is validated
-- even without a body (it is replayed as a header either way).

SELECT is(
    (idempotency.claim('e', 'status-null', '{}')).outcome, 'claimed',
    'claim a key for complete(status => NULL)'
);
SELECT is(
    (idempotency.claim('e', 'status-null-bytes', '{}')).outcome, 'claimed',
    'claim a key for complete_bytes(status => NULL)'
);
SELECT throws_ok(
    $$SELECT idempotency.complete('e', 'status-null',
        (SELECT lease_token FROM idempotency.keys WHERE scope = 'e' AND key = 'status-null'),
        NULL, '{"id": 1}')$$,
    'IK010', 'idempotency.complete: argument "status" must not be NULL',
    'complete: status NULL is IK010'
);
SELECT throws_ok(
    $$SELECT idempotency.complete_bytes('e', 'status-null-bytes',
        (SELECT lease_token FROM idempotency.keys
         WHERE scope = 'e' AND key = 'status-null-bytes'),
        NULL, '\x01'::bytea, 'a/b')$$,
    'IK010', 'idempotency.complete_bytes: argument "status" must not be NULL',
    'complete_bytes: status NULL is IK010'
);
SELECT results_eq(
    $$SELECT key, state, response_status FROM idempotency.keys
      WHERE scope = 'e' AND key IN ('status-null', 'status-null-bytes') ORDER BY key$$,
    $$VALUES ('status-null'::text, 'in_progress'::text, NULL::integer),
             ('status-null-bytes', 'in_progress', NULL)$$,
    'complete with status NULL leaves the key in progress (no completed row without a status)'
);
SELECT is(
    (idempotency.claim('e', 'no-body-content-type', '{}')).outcome, 'claimed',
    'claim a key for complete_bytes(body => NULL, content_type => bad)'
);
SELECT throws_ok(
    $$SELECT idempotency.complete_bytes('e', 'no-body-content-type',
        (SELECT lease_token FROM idempotency.keys
         WHERE scope = 'e' AND key = 'no-body-content-type'),
        204, NULL, E'text/html\r\nSet-Cookie: a=b')$$,
    'IK013',
    'idempotency.complete_bytes: argument "content_type" must not contain control characters',
    'complete_bytes: a content type with CR LF is IK013 even when the body is NULL'
);
SELECT is_empty(
    $$SELECT key, response_content_type FROM idempotency.keys
      WHERE scope = 'e' AND response_content_type ~ '[[:cntrl:]]'$$,
    'no content type with control characters was stored'
);

SELECT * FROM finish();

ROLLBACK;
