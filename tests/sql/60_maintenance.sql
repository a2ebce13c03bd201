-- idempotency.maintain() with an injected reference time: retention by partition drops, the
-- newest partition kept, partitions made ahead, rows moved out of (or deleted from) the default
-- partition, manage_partitions off, the report, and the status functions.
--
-- Days are counted from day 0, 1000 days before the day of install (below). Settings are the
-- defaults: daily partitions, retention 24 hours, 3 partitions ahead.
BEGIN;

SELECT plan(51);

-- d(n): the start (00:00 UTC) of the n-th day after the day of install.
CREATE FUNCTION pg_temp.d(n integer)
RETURNS timestamptz
LANGUAGE sql
STABLE
AS $$
    -- Days added in UTC: added to a timestamptz they follow the session's TimeZone, whose
    -- daylight-saving changes would move a day by an hour.
    SELECT (date_bin('1 day', m.applied_at, timestamptz '2000-01-01 00:00:00+00')
            AT TIME ZONE 'UTC' + (n - 1000) * interval '1 day') AT TIME ZONE 'UTC'
    FROM idempotency.migrations AS m WHERE m.version = 1
$$;

-- The test clock runs in the past: maintain() measures what it drops from now() at the latest
-- (a later reference_time would be clamped), so day 0 is 1000 days before the day of install
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

-- part(parent, n): the name (without schema) of parent's partition for day n.
CREATE FUNCTION pg_temp.part(parent text, n integer)
RETURNS text
LANGUAGE sql
STABLE
AS $$ SELECT parent || '_p' || to_char(pg_temp.d(n) AT TIME ZONE 'UTC', 'YYYYMMDD') $$;

-- parts(parent): parent's partitions, from the catalog.
CREATE FUNCTION pg_temp.parts(parent text)
RETURNS SETOF text
LANGUAGE sql
STABLE
AS $$
    SELECT c.relname::text COLLATE "default"
    FROM pg_inherits AS i INNER JOIN pg_class AS c ON i.inhrelid = c.oid
    WHERE i.inhparent = ('idempotency.' || parent)::regclass ORDER BY 1
$$;

-- home(key): the partition that holds the key of scope mt.
CREATE FUNCTION pg_temp.home(key text)
RETURNS text
LANGUAGE sql
STABLE
AS $$
    SELECT k.tableoid::regclass::text FROM idempotency.keys AS k
    WHERE k.scope = 'mt' AND k.key = $1
$$;

-- outcome(key, at): the outcome of a claim of key (scope mt, request {"v": 1}) at time at.
CREATE FUNCTION pg_temp.outcome(key text, at timestamptz)
RETURNS text
LANGUAGE sql
AS $$ SELECT (idempotency.claim('mt', key, '{"v": 1}', reference_time => at)).outcome $$;

-- done(key, at): claim and complete key at time at (status 201).
CREATE FUNCTION pg_temp.done(key text, at timestamptz)
RETURNS void
LANGUAGE sql
AS $$
    SELECT idempotency.complete('mt', key, c.lease_token, 201, '{"ok": true}',
                                reference_time => at + interval '1 second')
    FROM idempotency.claim('mt', key, '{"v": 1}', reference_time => at) AS c
$$;

-- run(at): maintain() at time at, its report kept in pg_temp.report.
CREATE TABLE pg_temp.report (LIKE idempotency.maintenance_action);
CREATE FUNCTION pg_temp.run(at timestamptz)
RETURNS bigint
LANGUAGE sql
AS $$
    DELETE FROM pg_temp.report;
    INSERT INTO pg_temp.report SELECT * FROM idempotency.maintain(at);
    SELECT count(*) FROM pg_temp.report;
$$;

-- A key on day 0 --------------------------------------------------------------------------------

SELECT lives_ok(
    $$SELECT pg_temp.done('d0', pg_temp.d(0) + interval '12 hours')$$,
    'a key claimed and completed on day 0 at noon'
);
SELECT is(
    pg_temp.home('d0'), 'idempotency.' || pg_temp.part('keys', 0),
    'it is in day 0''s partition'
);
SELECT lives_ok(
    $$SELECT pg_temp.run(pg_temp.d(0) + interval '13 hours')$$,
    'maintain() on day 0 runs'
);
SELECT is_empty(
    $$SELECT * FROM pg_temp.report WHERE action <> 'created'$$,
    'on day 0 it drops nothing'
);
SELECT is(
    pg_temp.outcome('d0', pg_temp.d(1) + interval '11 hours 59 minutes'), 'replay',
    'a retry just before created_at + retention replays'
);
SELECT lives_ok(
    $$SELECT pg_temp.run(pg_temp.d(1) + interval '23 hours')$$,
    'maintain() at the end of day 1 runs'
);
SELECT is_empty(
    $$SELECT * FROM pg_temp.report WHERE action = 'dropped'$$,
    'the partition of day 0 is not wholly older than the retention yet: nothing dropped'
);
SELECT is(
    pg_temp.outcome('d0', pg_temp.d(1) + interval '23 hours 30 minutes'), 'replay',
    'so the key still replays (retention is a minimum; the partition is the unit)'
);
SELECT is(
    pg_temp.outcome('d0', pg_temp.d(5)), 'replay',
    'without maintenance, a key past its retention still replays (nothing executes twice)'
);

-- Maintenance past the retention ------------------------------------------------------------------

-- Since 0.11.0 the partition holding the newest keys is never dropped (no reference_time can
-- empty the table): a key of day 1 lets day 0 go.
SELECT lives_ok(
    $$SELECT pg_temp.done('d1', pg_temp.d(1) + interval '12 hours')$$,
    'a key claimed and completed on day 1 at noon'
);
SELECT lives_ok(
    $$SELECT pg_temp.run(pg_temp.d(2))$$,
    'maintain() at the start of day 2 (day 0 end + retention) runs'
);
SELECT results_eq(
    $$SELECT action, parent_table, partition_name, lower_bound, upper_bound, row_count
      FROM pg_temp.report WHERE action = 'dropped' ORDER BY parent_table$$,
    $$VALUES ('dropped'::text, 'inbox'::text, pg_temp.part('inbox', 0), pg_temp.d(0), pg_temp.d(1),
              0::bigint),
             ('dropped', 'keys', pg_temp.part('keys', 0), pg_temp.d(0), pg_temp.d(1), 1)$$,
    'it reports dropping day 0 of keys (1 row) and of inbox'
);
SELECT is(
    to_regclass('idempotency.' || pg_temp.part('keys', 0)), NULL,
    'the partition of day 0 is gone (pg_class)'
);
SELECT is(
    (
        SELECT count(*) FROM idempotency.keys
        WHERE scope = 'mt' AND key = 'd0'
    ),
    0::bigint,
    'and the key with it'
);
SELECT results_eq(
    $$SELECT action, partition_name, row_count FROM pg_temp.report
      WHERE parent_table = 'key_directory'$$,
    $$VALUES ('deleted'::text, 'key_directory'::text, 1::bigint)$$,
    'it reports deleting the directory row of the key it dropped (since 0.9.0)'
);
SELECT is(
    (
        SELECT count(*) FROM idempotency.key_directory
        WHERE scope = 'mt' AND key_hash = sha256('d0'::bytea)
    ),
    0::bigint,
    'and that directory row is gone'
);
SELECT results_eq(
    $$SELECT action, partition_name, lower_bound FROM pg_temp.report
      WHERE action = 'created' AND parent_table = 'keys' ORDER BY 2$$,
    $$VALUES ('created'::text, pg_temp.part('keys', 5), pg_temp.d(5))$$,
    'it creates day 5 of keys (the run on day 1 made day 4): the current day and 3 ahead exist'
);
SELECT results_eq(
    $$SELECT * FROM pg_temp.parts('keys')$$,
    $$SELECT pg_temp.part('keys', n) FROM generate_series(1, 5) AS n
      UNION ALL SELECT 'keys_default' ORDER BY 1$$,
    'keys partitions (pg_inherits): days 1 to 5 and the default'
);
SELECT results_eq(
    $$SELECT * FROM pg_temp.parts('inbox')$$,
    $$SELECT pg_temp.part('inbox', n) FROM generate_series(1, 5) AS n
      UNION ALL SELECT 'inbox_default' ORDER BY 1$$,
    'inbox partitions: the same'
);
SELECT is(
    pg_temp.outcome('d0', pg_temp.d(2) + interval '1 minute'), 'claimed',
    'with tombstones off, a retry of the dropped key is a new request: claimed'
);
SELECT is(
    pg_temp.run(pg_temp.d(2) + interval '2 minutes'), 0::bigint,
    'a second run at the same time has nothing to do: empty report'
);

-- The newest partition --------------------------------------------------------------------------

SELECT is(
    pg_temp.outcome('d400', pg_temp.d(400)), 'claimed',
    'a key claimed on day 400 (in keys_default: no partition for that day yet)'
);
SELECT lives_ok(
    $$SELECT pg_temp.run(pg_temp.d(400))$$,
    'maintain() 400 days later runs'
);
SELECT results_eq(
    $$SELECT action, partition_name, reason FROM pg_temp.report
      WHERE parent_table = 'keys' AND partition_name = pg_temp.part('keys', 5)$$,
    $$VALUES ('skipped'::text, pg_temp.part('keys', 5),
              'the newest partition is never dropped'::text)$$,
    'it skips the newest partition of keys, and says why'
);
SELECT isnt(
    to_regclass('idempotency.' || pg_temp.part('keys', 5)), NULL,
    'the newest partition still exists'
);
SELECT results_eq(
    $$SELECT count(*) FROM pg_temp.report WHERE action = 'dropped' AND parent_table = 'keys'$$,
    $$VALUES (4::bigint)$$,
    'the four older partitions of keys were dropped'
);
SELECT results_eq(
    $$SELECT count(*) FROM pg_temp.parts('keys') AS p (name)
      WHERE name BETWEEN pg_temp.part('keys', 400) AND pg_temp.part('keys', 403)$$,
    $$VALUES (4::bigint)$$,
    'and the partitions of day 400 and 3 ahead were made'
);

-- The default partition -------------------------------------------------------------------------

SELECT is(
    pg_temp.outcome('gap', pg_temp.d(405) + interval '1 hour'), 'claimed',
    'a claim on a day without a partition (maintenance did not run) is claimed'
);
SELECT is(pg_temp.home('gap'), 'idempotency.keys_default', 'it lands in keys_default');
SELECT is(
    pg_temp.outcome('far-past', '2001-02-03 04:05:06+00'), 'claimed',
    'a claim dated long ago lands in keys_default too'
);
SELECT is(
    pg_temp.outcome('far-future', '2999-01-01 00:00:00+00'), 'claimed',
    'so does one dated far ahead'
);
SELECT lives_ok(
    $$SELECT pg_temp.run(pg_temp.d(405) + interval '2 hours')$$,
    'maintain() on that day runs'
);
SELECT results_eq(
    $$SELECT action, partition_name, lower_bound, row_count FROM pg_temp.report
      WHERE parent_table = 'keys' AND action IN ('moved', 'deleted') ORDER BY 1$$,
    $$VALUES ('deleted'::text, 'keys_default'::text, NULL::timestamptz, 1::bigint),
             ('moved', pg_temp.part('keys', 405), pg_temp.d(405), 1)$$,
    'it deletes the expired row from keys_default and moves the live one into a new partition'
);
SELECT is(
    pg_temp.home('gap'), 'idempotency.' || pg_temp.part('keys', 405),
    'the live key now lives in the partition of its day'
);
SELECT lives_ok(
    $$SELECT idempotency.complete('mt', 'gap',
        (SELECT k.lease_token FROM idempotency.keys AS k WHERE k.scope = 'mt' AND k.key = 'gap'),
        200, '{"moved": true}', reference_time => pg_temp.d(405) + interval '3 hours')$$,
    'its holder completes it after the move, with the same token'
);
SELECT is(
    pg_temp.home('far-past'), NULL,
    'the row dated long ago is gone'
);
SELECT results_eq(
    $$SELECT action, reason FROM pg_temp.report
      WHERE parent_table = 'keys' AND lower_bound = '2999-01-01 00:00:00+00'$$,
    $$VALUES ('skipped'::text,
              'rows dated after the partitions made ahead stay in the default partition'::text)$$,
    'the row dated far ahead is reported and left in keys_default'
);
SELECT is(pg_temp.home('far-future'), 'idempotency.keys_default', 'where it still is');

-- Status ---------------------------------------------------------------------------------------

SELECT is(
    pg_temp.outcome('stuck', pg_temp.d(405) + interval '2 hours 30 minutes'), 'claimed',
    'a key whose holder goes away (its lease expires 30 seconds later)'
);
SELECT lives_ok(
    $$SELECT idempotency.release('mt', 'let-go',
        (idempotency.claim('mt', 'let-go', '{"v": 1}',
                           reference_time => pg_temp.d(405) + interval '2 hours 40 minutes'
        )).lease_token)$$,
    'a key claimed and released (its row stays, released, until a claim)'
);

SELECT results_eq(
    $$SELECT scope, state, keys, oldest_key, expired_leases
      FROM idempotency.key_status(pg_temp.d(405) + interval '4 hours')
      WHERE scope = 'mt' ORDER BY state$$,
    $$VALUES ('mt'::text, 'completed'::text, 1::bigint, NULL::text, 0::bigint),
             ('mt', 'in_progress', 2, 'stuck', 1),
             ('mt', 'released', 1, NULL, 0)$$,
    'key_status: per scope and state (released too), the oldest key in progress, expired '
    || 'leases'
);
SELECT results_eq(
    $$SELECT partition_name, row_count, note, drop_after FROM idempotency.partition_status(
          pg_temp.d(405) + interval '4 hours')
      WHERE parent_table = 'keys' AND partition_name IN (pg_temp.part('keys', 405),
                                                         pg_temp.part('keys', 408), 'keys_default')
      ORDER BY 1$$,
    $$VALUES ('keys_default'::text, 1::bigint, 'default'::text, NULL::timestamptz),
             (pg_temp.part('keys', 405), 3, 'current', pg_temp.d(407)),
             (pg_temp.part('keys', 408), 0, 'newest', NULL)$$,
    'partition_status: rows, note and when each partition will be dropped'
);
SELECT ok(
    (SELECT bool_and(total_bytes > 0) FROM idempotency.partition_status()),
    'partition_status: sizes are reported'
);

-- manage_partitions off (pg_partman manages them) ---------------------------------------------

UPDATE idempotency.settings SET manage_partitions = false;

SELECT lives_ok(
    $$SELECT pg_temp.run(pg_temp.d(900))$$,
    'with manage_partitions off, maintain() runs'
);
SELECT results_eq(
    $$SELECT action, parent_table FROM pg_temp.report
      WHERE parent_table NOT IN ('tombstones', 'key_directory') ORDER BY 2$$,
    $$VALUES ('skipped'::text, 'inbox'::text), ('skipped', 'keys')$$,
    'and reports keys and inbox as skipped, nothing else'
);
SELECT isnt(
    to_regclass('idempotency.' || pg_temp.part('keys', 405)), NULL,
    'their partitions are left alone'
);

-- Arguments and settings -----------------------------------------------------------------------

SELECT throws_ok(
    $$SELECT * FROM idempotency.maintain(NULL)$$,
    'IK010', 'idempotency.maintain: argument "reference_time" must not be NULL',
    'maintain(NULL): IK010'
);
SELECT throws_ok(
    $$SELECT idempotency.schedule_maintenance('*/10 * * * *')$$,
    'IK020', 'idempotency.schedule_maintenance: pg_cron is not installed in this database',
    'schedule_maintenance without pg_cron: IK020'
);
SELECT throws_ok(
    $$SELECT idempotency.unschedule_maintenance()$$,
    'IK020', 'idempotency.unschedule_maintenance: pg_cron is not installed in this database',
    'unschedule_maintenance without pg_cron: IK020'
);
SELECT throws_ok(
    $$SELECT idempotency.schedule_maintenance(NULL)$$,
    'IK010', 'idempotency.schedule_maintenance: argument "schedule" must not be NULL',
    'schedule_maintenance(NULL): IK010'
);
SELECT throws_ok(
    $$UPDATE idempotency.settings SET tombstone_retention = '12 hours'$$,
    '23514', NULL,
    'tombstone_retention must exceed retention'
);

SELECT * FROM finish();

ROLLBACK;
