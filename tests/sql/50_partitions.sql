-- Partitions of idempotency.keys and idempotency.inbox: what install made, where rows land
-- (the default partition, either side of a boundary), that a key is found whichever partition
-- holds it, and that _premake and _create_partition are idempotent.
--
-- Days are counted from the day of install (idempotency.migrations.applied_at), not from
-- now(), so the test holds even when it runs a day or more after the template was built.
BEGIN;

SELECT plan(51);

-- d(n): the start (00:00 UTC) of the n-th day after the day of install.
CREATE FUNCTION pg_temp.d(n integer)
RETURNS timestamptz
LANGUAGE sql
STABLE
AS $$
    SELECT date_bin('1 day', m.applied_at, timestamptz '2000-01-01 00:00:00+00')
           + n * interval '1 day'
    FROM idempotency.migrations AS m WHERE m.version = 1
$$;

-- part(parent, n): the qualified name of parent's partition for day n, spelt out here rather
-- than by idempotency._partition_name.
CREATE FUNCTION pg_temp.part(parent text, n integer)
RETURNS text
LANGUAGE sql
STABLE
AS $$
    SELECT 'idempotency.' || parent || '_p' || to_char(pg_temp.d(n) AT TIME ZONE 'UTC', 'YYYYMMDD')
$$;

-- home(scope, key): the partition that holds the key.
CREATE FUNCTION pg_temp.home(scope text, key text)
RETURNS text
LANGUAGE sql
STABLE
AS $$
    SELECT k.tableoid::regclass::text FROM idempotency.keys AS k WHERE k.scope = $1 AND k.key = $2
$$;

-- n(scope, key): how many rows the key has.
CREATE FUNCTION pg_temp.n(scope text, key text)
RETURNS bigint
LANGUAGE sql
STABLE
AS $$ SELECT count(*) FROM idempotency.keys AS k WHERE k.scope = $1 AND k.key = $2 $$;

-- outcome(key, request, at): the outcome of a claim of key in scope pt at reference time at.
CREATE FUNCTION pg_temp.outcome(key text, request jsonb, at timestamptz)
RETURNS text
LANGUAGE sql
AS $$ SELECT (idempotency.claim('pt', key, request, reference_time => at)).outcome $$;

-- tok(key): the current lease token of key in scope pt.
CREATE FUNCTION pg_temp.tok(key text)
RETURNS bigint
LANGUAGE sql
STABLE
AS $$ SELECT k.lease_token FROM idempotency.keys AS k WHERE k.scope = 'pt' AND k.key = $1 $$;

-- What install made ----------------------------------------------------------------------------

SELECT results_eq(
    $$SELECT c.oid::regclass::text, pg_get_expr(c.relpartbound, c.oid) COLLATE "default"
      FROM pg_inherits AS i INNER JOIN pg_class AS c ON i.inhrelid = c.oid
      WHERE i.inhparent = 'idempotency.keys'::regclass ORDER BY 1$$,
    $$SELECT pg_temp.part('keys', n),
             format('FOR VALUES FROM (%L) TO (%L)', pg_temp.d(n), pg_temp.d(n + 1))
      FROM generate_series(0, 3) AS n
      UNION ALL
      SELECT 'idempotency.keys_default', 'DEFAULT'
      ORDER BY 1$$,
    'install made keys partitions for the day of install and 3 ahead, plus keys_default'
);
SELECT results_eq(
    $$SELECT c.oid::regclass::text, pg_get_expr(c.relpartbound, c.oid) COLLATE "default"
      FROM pg_inherits AS i INNER JOIN pg_class AS c ON i.inhrelid = c.oid
      WHERE i.inhparent = 'idempotency.inbox'::regclass ORDER BY 1$$,
    $$SELECT pg_temp.part('inbox', n),
             format('FOR VALUES FROM (%L) TO (%L)', pg_temp.d(n), pg_temp.d(n + 1))
      FROM generate_series(0, 3) AS n
      UNION ALL
      SELECT 'idempotency.inbox_default', 'DEFAULT'
      ORDER BY 1$$,
    'install made inbox partitions for the day of install and 3 ahead, plus inbox_default'
);
SELECT is_empty(
    $$SELECT c.oid::regclass FROM pg_inherits AS i INNER JOIN pg_class AS c ON i.inhrelid = c.oid
      WHERE i.inhparent = 'idempotency.keys'::regclass AND c.relname LIKE 'keys\_p%'
        AND NOT coalesce('fillfactor=80' = ANY(c.reloptions), false)$$,
    'keys partitions have fillfactor 80 (room for HOT updates by complete)'
);
SELECT results_eq(
    $$SELECT partition_interval, premake FROM idempotency.settings$$,
    $$VALUES (interval '1 day', 3)$$,
    'default settings: daily partitions, 3 made ahead'
);

-- The default partition is the safety net ------------------------------------------------------

SELECT is(
    pg_temp.outcome('far-past', '{"x": 1}', '2001-02-03 04:05:06+00'),
    'claimed',
    'a claim far before any partition is claimed'
);
SELECT is(
    pg_temp.home('pt', 'far-past'), 'idempotency.keys_default',
    'it lands in keys_default'
);
SELECT lives_ok(
    $$SELECT idempotency.complete('pt', 'far-past',
        pg_temp.tok('far-past'),
        200, '{"old": true}', reference_time => '2001-02-03 04:05:07+00')$$,
    'the key in keys_default can be completed'
);
SELECT results_eq(
    $$SELECT outcome, response_body FROM idempotency.claim('pt', 'far-past', '{"x": 1}',
                                                           reference_time => now())$$,
    $$VALUES ('replay'::text, '{"old": true}'::jsonb)$$,
    'a later claim finds the key in keys_default: replay'
);
SELECT is(
    idempotency._create_partition('keys', '2001-02-03 00:00+00', '2001-02-04 00:00+00'), false,
    '_create_partition refuses a range whose rows sit in keys_default'
);
SELECT is(
    to_regclass('idempotency.keys_p20010203'), NULL,
    'and no partition was made for it'
);
SELECT is(
    pg_temp.home('pt', 'far-past'), 'idempotency.keys_default',
    'the row stays in keys_default'
);
SELECT is(
    pg_temp.outcome('far-future', '{}', '2099-01-01 00:00+00'),
    'claimed',
    'a claim far after any partition is claimed'
);
SELECT is(
    pg_temp.home('pt', 'far-future'), 'idempotency.keys_default',
    'it lands in keys_default too'
);
SELECT is(
    pg_temp.outcome('far-future', '{}', '2099-01-01 00:00:10+00'),
    'in_progress',
    'a later claim finds it: in_progress'
);
SELECT is(
    pg_temp.n('pt', 'far-past') + pg_temp.n('pt', 'far-future'), 2::bigint,
    'one row per key in keys_default'
);

-- Both sides of a partition boundary -----------------------------------------------------------

SELECT is(
    pg_temp.outcome('edge-1', '{}', pg_temp.d(1) - interval '1 millisecond'),
    'claimed',
    'claim at 23:59:59.999 UTC'
);
SELECT is(
    pg_temp.outcome('edge-2', '{}', pg_temp.d(1) + interval '1 millisecond'),
    'claimed',
    'claim at 00:00:00.001 UTC the next day'
);
SELECT is(
    pg_temp.home('pt', 'edge-1'), pg_temp.part('keys', 0),
    'the claim at 23:59:59.999 lands in that day''s partition'
);
SELECT is(
    pg_temp.home('pt', 'edge-2'), pg_temp.part('keys', 1),
    'the claim at 00:00:00.001 lands in the next day''s partition'
);
SELECT is(
    pg_temp.outcome('edge-1', '{}', pg_temp.d(1) + interval '1 millisecond'),
    'in_progress',
    'a claim of the first key after midnight finds it in the previous partition'
);
SELECT is(
    pg_temp.outcome('edge-1', '{}', pg_temp.d(1) + interval '1 minute'),
    'resumed',
    'once its lease expired, a claim after midnight resumes it'
);
SELECT is(
    pg_temp.outcome('edge-1', '{"other": true}', pg_temp.d(1) + interval '2 minutes'),
    'mismatch',
    'a different request after midnight is a mismatch against the previous day''s key'
);
SELECT results_eq(
    $$SELECT count(*), min(attempts), min(k.tableoid::regclass::text)
      FROM idempotency.keys AS k WHERE k.scope = 'pt' AND k.key = 'edge-1'$$,
    $$VALUES (1::bigint, 2, pg_temp.part('keys', 0))$$,
    'still one row for the first key, in its own partition, attempts 2'
);

-- A key claimed yesterday is found today -------------------------------------------------------

SELECT is(
    idempotency._create_partition('keys', pg_temp.d(-1), pg_temp.d(0)), true,
    '_create_partition makes the keys partition of the day before install'
);
SELECT is(
    to_regclass(pg_temp.part('keys', -1))::text, pg_temp.part('keys', -1),
    'it is named keys_pYYYYMMDD'
);
SELECT is(
    pg_temp.outcome('y-1', '{"y": 1}', pg_temp.d(-1) + interval '12 hours'),
    'claimed',
    'claim a key yesterday'
);
SELECT is(
    pg_temp.home('pt', 'y-1'), pg_temp.part('keys', -1),
    'it lands in yesterday''s partition'
);
SELECT is(
    pg_temp.outcome('y-1', '{"y": 1}', pg_temp.d(0) + interval '12 hours'),
    'resumed',
    'a claim today finds yesterday''s expired key and resumes it (no second row)'
);
SELECT is(
    idempotency.complete(
        'pt', 'y-1',
        pg_temp.tok('y-1'),
        200, '{"y": "done"}', reference_time => pg_temp.d(0) + interval '13 hours'
    ),
    pg_temp.d(0) + interval '13 hours',
    'today''s holder completes yesterday''s key'
);
SELECT results_eq(
    $$SELECT outcome, response_body
      FROM idempotency.claim('pt', 'y-1', '{"y": 1}', reference_time => pg_temp.d(2))$$,
    $$VALUES ('replay'::text, '{"y": "done"}'::jsonb)$$,
    'two days later: replay'
);
SELECT results_eq(
    $$SELECT count(*), min(k.tableoid::regclass::text), min(attempts)
      FROM idempotency.keys AS k WHERE k.scope = 'pt' AND k.key = 'y-1'$$,
    $$VALUES (1::bigint, pg_temp.part('keys', -1), 2)$$,
    'one row, still in yesterday''s partition'
);

-- _premake and _create_partition are idempotent ------------------------------------------------

SELECT is(
    idempotency._premake(pg_temp.d(0) + interval '23 hours 59 minutes'), 0,
    '_premake on the day of install creates nothing more'
);
SELECT is(
    idempotency._premake(pg_temp.d(10) + interval '5 hours'), 8,
    '_premake ten days ahead creates 4 keys and 4 inbox partitions (the directory has none)'
);
SELECT results_eq(
    $$SELECT c.relkind::text,
             (SELECT array_agg(a.attname::text COLLATE "default" ORDER BY k.n)
              FROM pg_index AS i
              CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k (attnum, n)
              INNER JOIN pg_attribute AS a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
              WHERE i.indrelid = c.oid AND i.indisprimary)
      FROM pg_class AS c WHERE c.oid = 'idempotency.key_directory'::regclass$$,
    $$VALUES ('r'::text, ARRAY['scope', 'key_hash'])$$,
    'key_directory is a plain table (since 0.9.0), its primary key (scope, key_hash)'
);
SELECT is(
    idempotency._premake(pg_temp.d(10) + interval '5 hours'), 0,
    'a second run creates 0'
);
SELECT is(
    (
        SELECT count(*) FROM generate_series(10, 13) AS n
        CROSS JOIN (VALUES ('keys'), ('inbox')) AS p (parent)
        WHERE to_regclass(pg_temp.part(p.parent, n)) IS NOT NULL
    ),
    8::bigint,
    '_premake made the partitions of days 10 to 13 for both tables'
);
SELECT is(
    idempotency._premake(pg_temp.d(-1)), 1,
    '_premake from yesterday creates only the missing inbox partition'
);
SELECT is(
    idempotency._create_partition('keys', pg_temp.d(0), pg_temp.d(1)), false,
    '_create_partition of an existing partition: false'
);
SELECT is(
    idempotency._create_partition(
        'keys', pg_temp.d(0) + interval '12 hours', pg_temp.d(1) + interval '12 hours'
    ),
    false,
    '_create_partition of a range overlapping existing partitions: false'
);
SELECT is_empty(
    $$SELECT FROM pg_class
      WHERE relnamespace = 'idempotency'::regnamespace AND relname LIKE 'keys\_p%\_1200'$$,
    'and the overlapping partition was not made'
);
SELECT throws_ok(
    $$SELECT idempotency._create_partition('settings', now(), now() + interval '1 day')$$,
    'IK014', NULL,
    '_create_partition of another table: IK014'
);

-- inbox_accept ---------------------------------------------------------------------------------

SELECT is(
    idempotency.inbox_accept('pc', 'm-1', pg_temp.d(0) + interval '1 hour'), true,
    'inbox_accept: true the first time'
);
SELECT is(
    idempotency.inbox_accept('pc', 'm-1', pg_temp.d(0) + interval '2 hours'), false,
    'inbox_accept: false for a redelivery'
);
SELECT is(
    idempotency.inbox_accept('pc-other', 'm-1', pg_temp.d(0) + interval '1 hour'), true,
    'inbox_accept: the same message id for another consumer is new'
);
SELECT results_eq(
    $$SELECT consumer, message_id, received_at, i.tableoid::regclass::text
      FROM idempotency.inbox AS i WHERE message_id = 'm-1' ORDER BY consumer$$,
    $$VALUES ('pc'::text, 'm-1'::text, pg_temp.d(0) + interval '1 hour', pg_temp.part('inbox', 0)),
             ('pc-other', 'm-1', pg_temp.d(0) + interval '1 hour', pg_temp.part('inbox', 0))$$,
    'inbox: one row per (consumer, message id), received_at of the first delivery'
);
SELECT is(
    idempotency.inbox_accept('pc', 'm-2', pg_temp.d(1) - interval '1 millisecond'), true,
    'inbox_accept at 23:59:59.999: true'
);
SELECT is(
    idempotency.inbox_accept('pc', 'm-2', pg_temp.d(1) + interval '1 millisecond'), false,
    'inbox_accept of the same message at 00:00:00.001 the next day: false'
);
SELECT is(
    idempotency.inbox_accept('pc', 'm-2', pg_temp.d(3) + interval '1 hour'), false,
    'inbox_accept of the same message three days later: false'
);
SELECT is(
    idempotency.inbox_accept('pc', 'm-3', '2001-01-01 00:00+00'), true,
    'inbox_accept far in the past: true'
);
SELECT is(
    idempotency.inbox_accept('pc', 'm-3', now()), false,
    'the message in inbox_default is found by a later delivery: false'
);
SELECT results_eq(
    $$SELECT message_id, count(*), min(i.tableoid::regclass::text)
      FROM idempotency.inbox AS i WHERE consumer = 'pc' GROUP BY message_id ORDER BY 1$$,
    $$VALUES ('m-1'::text, 1::bigint, pg_temp.part('inbox', 0)),
             ('m-2', 1, pg_temp.part('inbox', 0)),
             ('m-3', 1, 'idempotency.inbox_default')$$,
    'inbox: one row per message, in the partition of its first delivery'
);

SELECT * FROM finish();

ROLLBACK;
