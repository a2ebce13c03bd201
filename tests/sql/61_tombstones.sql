-- Tombstones (settings.tombstones): a retry after the response retention but inside the
-- tombstone window gets outcome expired, never a second execution; after the window, or with
-- tombstones off, an expired key is a new request.
--
-- Days are counted from day 0, 100 days before the day of install (below). Retention 24 hours,
-- tombstone_retention 10 days.
BEGIN;

SELECT plan(25);

CREATE FUNCTION pg_temp.d(n integer)
RETURNS timestamptz
LANGUAGE sql
STABLE
AS $$
    -- Days added in UTC: added to a timestamptz they follow the session's TimeZone, whose
    -- daylight-saving changes would move a day by an hour.
    SELECT (date_bin('1 day', m.applied_at, timestamptz '2000-01-01 00:00:00+00')
            AT TIME ZONE 'UTC' + (n - 100) * interval '1 day') AT TIME ZONE 'UTC'
    FROM idempotency.migrations AS m WHERE m.version = 1
$$;

-- The test clock runs in the past: maintain() measures what it drops from now() at the latest
-- (a later reference_time would be clamped), so day 0 is 100 days before the day of install
-- and every time below is before now(). The partitions the install made (its day and after,
-- all empty) make way for day 0's, as an install on day 0 would have made them.
DO $$
DECLARE
    v_part record;
BEGIN
    FOR v_part IN
        SELECT p.partition_name FROM unnest(ARRAY['keys', 'inbox', 'tombstones']) AS t (parent)
        CROSS JOIN LATERAL idempotency._partitions(t.parent) AS p
        WHERE NOT p.is_default
    LOOP
        EXECUTE format('DROP TABLE idempotency.%I', v_part.partition_name);
    END LOOP;
    PERFORM idempotency._premake(pg_temp.d(0));
    PERFORM idempotency._make_routes();
END
$$;

CREATE FUNCTION pg_temp.part(parent text, n integer)
RETURNS text
LANGUAGE sql
STABLE
AS $$ SELECT parent || '_p' || to_char(pg_temp.d(n) AT TIME ZONE 'UTC', 'YYYYMMDD') $$;

-- claim(key, request, at): the claim's outcome, response_status and created_at.
CREATE FUNCTION pg_temp.claim(key text, request jsonb, at timestamptz)
RETURNS TABLE (outcome text, response_status integer, created_at timestamptz)
LANGUAGE sql
AS $$
    SELECT c.outcome, c.response_status, c.created_at
    FROM idempotency.claim('tb', key, request, reference_time => at) AS c
$$;

CREATE FUNCTION pg_temp.n(key text)
RETURNS bigint
LANGUAGE sql
STABLE
AS $$ SELECT count(*) FROM idempotency.keys AS k WHERE k.scope = 'tb' AND k.key = $1 $$;

CREATE TABLE pg_temp.report (LIKE idempotency.maintenance_action);
CREATE FUNCTION pg_temp.run(at timestamptz)
RETURNS bigint
LANGUAGE sql
AS $$
    DELETE FROM pg_temp.report;
    INSERT INTO pg_temp.report SELECT * FROM idempotency.maintain(at);
    SELECT count(*) FROM pg_temp.report;
$$;

UPDATE idempotency.settings SET tombstones = true, tombstone_retention = '10 days';

-- Day 0: one key completed (201), one whose work never finished.
SELECT lives_ok(
    $$SELECT idempotency.complete('tb', 'paid', c.lease_token, 201, '{"id": "ch_1"}',
                                  reference_time => pg_temp.d(0) + interval '12 hours 1 second')
      FROM idempotency.claim('tb', 'paid', '{"amount": 50}',
                             reference_time => pg_temp.d(0) + interval '12 hours') AS c$$,
    'day 0: key paid claimed and completed with status 201'
);
SELECT is(
    (pg_temp.claim('open', '{"amount": 7}', pg_temp.d(0) + interval '13 hours')).outcome,
    'claimed',
    'day 0: key open claimed, never completed'
);

-- Day 1: a newer key, so that day 0 is not the partition holding the newest keys (never
-- dropped since 0.11.0).
SELECT is(
    (pg_temp.claim('later', '{}', pg_temp.d(1) + interval '12 hours')).outcome, 'claimed',
    'day 1: key later claimed'
);

SELECT lives_ok($$SELECT pg_temp.run(pg_temp.d(2))$$, 'maintain() on day 2 runs');
SELECT results_eq(
    $$SELECT action, partition_name, row_count FROM pg_temp.report
      WHERE parent_table = 'keys' AND action IN ('tombstoned', 'dropped') ORDER BY 1$$,
    $$VALUES ('dropped'::text, pg_temp.part('keys', 0), 2::bigint),
             ('tombstoned', pg_temp.part('keys', 0), 2)$$,
    'it writes 2 tombstones, then drops the partition of day 0 with its 2 keys'
);
SELECT results_eq(
    $$SELECT action, partition_name, row_count FROM pg_temp.report
      WHERE parent_table = 'tombstones' AND action = 'moved'$$,
    $$VALUES ('moved'::text, pg_temp.part('tombstones', 0), 2::bigint)$$,
    'the tombstones of day 0 get a partition of their own (none was made before tombstones were on)'
);
SELECT results_eq(
    $$SELECT count(*) FROM pg_temp.report
      WHERE parent_table = 'tombstones' AND action = 'created'$$,
    $$VALUES (4::bigint)$$,
    'and tombstone partitions are made ahead, like keys: the current day and 3 ahead'
);
SELECT results_eq(
    $$SELECT scope, encode(key_hash, 'hex'), final_state, response_status, created_at, expires_at
      FROM idempotency.tombstones ORDER BY created_at$$,
    $$VALUES ('tb'::text, encode(sha256('paid'::bytea), 'hex'), 'completed'::text, 201,
              pg_temp.d(0) + interval '12 hours', pg_temp.d(10) + interval '12 hours'),
             ('tb', encode(sha256('open'::bytea), 'hex'), 'in_progress', NULL,
              pg_temp.d(0) + interval '13 hours', pg_temp.d(10) + interval '13 hours')$$,
    'a tombstone is scope, sha256 of the key, final state and status, created_at, expires_at'
);
SELECT is(
    (
        SELECT count(*) FROM idempotency.tombstones
        WHERE fingerprint = idempotency.fingerprint('{"amount": 50}')
    ),
    1::bigint,
    'and it keeps the fingerprint'
);

-- Retries inside the tombstone window ------------------------------------------------------

SELECT results_eq(
    $$SELECT * FROM pg_temp.claim('paid', '{"amount": 50}', pg_temp.d(2) + interval '1 hour')$$,
    $$VALUES ('expired'::text, 201, pg_temp.d(0) + interval '12 hours')$$,
    'a retry of the completed key after its retention: expired, with the final status'
);
SELECT is(pg_temp.n('paid'), 0::bigint, 'and no new key row: nothing is executed again');
SELECT is(
    (pg_temp.claim('paid', '{"amount": 51}', pg_temp.d(3))).outcome, 'expired',
    'a retry with another request: expired too'
);
SELECT results_eq(
    $$SELECT * FROM pg_temp.claim('open', '{"amount": 7}', pg_temp.d(9))$$,
    $$VALUES ('expired'::text, NULL::integer, pg_temp.d(0) + interval '13 hours')$$,
    'a retry of the key whose work never finished: expired, no status'
);
SELECT is(pg_temp.n('open'), 0::bigint, 'no new key row for it either');
SELECT throws_ok(
    $$SELECT idempotency.takeover('tb', 'paid', reference_time => pg_temp.d(3))$$,
    'IK003', NULL,
    'takeover of a tombstoned key: IK003 (there is no key to take over)'
);
SELECT is(
    (pg_temp.claim('fresh', '{}', pg_temp.d(3))).outcome, 'claimed',
    'another key is unaffected: claimed'
);

-- After the tombstone window ---------------------------------------------------------------------

SELECT is(
    (pg_temp.claim('paid', '{"amount": 50}', pg_temp.d(10) + interval '12 hours')).outcome,
    'claimed',
    'at created_at + tombstone_retention the tombstone no longer counts, even before it is dropped'
);
SELECT lives_ok($$SELECT pg_temp.run(pg_temp.d(11))$$, 'maintain() on day 11 runs');
SELECT results_eq(
    $$SELECT action, partition_name, row_count FROM pg_temp.report
      WHERE parent_table = 'tombstones' AND action = 'dropped'$$,
    $$VALUES ('dropped'::text, pg_temp.part('tombstones', 0), 2::bigint)$$,
    'it drops the tombstone partition of day 0 (wholly older than tombstone_retention)'
);
SELECT is(
    (
        SELECT count(*) FROM idempotency.tombstones
        WHERE created_at < pg_temp.d(1)
    ),
    0::bigint,
    'those tombstones are gone'
);

-- Tombstones in the default partition, and turning them off --------------------------------------

SELECT is(
    (pg_temp.claim('fresh', '{}', pg_temp.d(11) + interval '1 hour')).outcome, 'expired',
    'the key claimed on day 3 was dropped on day 11 with a tombstone: expired'
);
UPDATE idempotency.settings SET tombstones = false;
SELECT is(
    (pg_temp.claim('fresh', '{}', pg_temp.d(11) + interval '2 hours')).outcome, 'expired',
    'tombstones turned off: existing tombstones still count until maintain() runs'
);
SELECT lives_ok($$SELECT pg_temp.run(pg_temp.d(11) + interval '3 hours')$$, 'maintain() runs');
SELECT is(
    (SELECT count(*) FROM idempotency.tombstones), 0::bigint,
    'with tombstones off it removes them all'
);
SELECT is(
    (pg_temp.claim('fresh', '{}', pg_temp.d(11) + interval '4 hours')).outcome, 'claimed',
    'and an expired key is a new request again'
);

SELECT * FROM finish();

ROLLBACK;
