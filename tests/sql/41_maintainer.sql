-- grant_usage(kind => 'maintainer'): a scheduler's role runs maintain() at the clock, schedules
-- and unschedules it, reads the status, and does nothing else. The list of what it is refused
-- is read from the catalog, so a function added later is covered without editing this file.
--
-- As in 40_privileges.sql, the roles are made in this transaction and roll back with it, and a
-- call "as" a role goes through pg_temp.as_role(). tests/server/test_maintainer.py runs the same
-- role as a LOGIN role, with hostile settings, and tests/sql/test_pg_cron.py has pg_cron run it.
BEGIN;

SELECT plan(26);

CREATE ROLE idem_t41_maintainer NOLOGIN;
CREATE ROLE idem_t41_other NOLOGIN;

-- as_role(role_name, sql): run sql as role_name; returns the first column of a query's first row.
CREATE FUNCTION pg_temp.as_role(role_name text, sql text)
RETURNS text
LANGUAGE plpgsql
AS $$
DECLARE
    v_result text;
BEGIN
    PERFORM set_config('role', role_name, true);
    IF sql ~* '^\s*(select|values|with)\M' THEN
        EXECUTE sql INTO v_result;
    ELSE
        EXECUTE sql;
    END IF;
    PERFORM set_config('role', 'none', true);
    RETURN v_result;
END;
$$;

CREATE FUNCTION pg_temp.as_maintainer(sql text)
RETURNS text
LANGUAGE sql
AS $$ SELECT pg_temp.as_role('idem_t41_maintainer', sql) $$;

-- What a maintainer may execute and read: everything else in the schema is refused.
CREATE TEMP TABLE allowed_functions (signature regprocedure PRIMARY KEY) ON COMMIT DROP;
INSERT INTO allowed_functions VALUES
('idempotency.maintain(timestamptz)'),
('idempotency.schedule_maintenance(text)'),
('idempotency.unschedule_maintenance()'),
('idempotency.key_status(timestamptz)'),
('idempotency.partition_status(timestamptz)'),
('idempotency.metrics(timestamptz, boolean)'),
('idempotency.metrics_by_scope(timestamptz)'),
-- schedule_maintenance and unschedule_maintenance run as their caller (so that pg_cron runs
-- the job as the maintainer) and call these three checks, which only raise.
('idempotency._require_coordinator(text, text)'),
('idempotency._require_pg_cron(text)'),
('idempotency._invalid_argument(text, text, text, text, text)');

-- Before the grant -----------------------------------------------------------------------------

SELECT throws_ok(
    $$SELECT pg_temp.as_maintainer('SELECT count(*) FROM idempotency.maintain()')$$,
    '42501', 'permission denied for schema idempotency',
    'before grant_usage: maintain is refused'
);

-- The grant ------------------------------------------------------------------------------------

SELECT lives_ok(
    $$SELECT idempotency.grant_usage('idem_t41_maintainer', kind => 'maintainer')$$,
    'grant_usage(kind => maintainer)'
);
SELECT results_eq(
    $$SELECT grantee::text, kind, scopes FROM idempotency.grants
      WHERE grantee = 'idem_t41_maintainer'::regrole$$,
    $$VALUES ('idem_t41_maintainer'::text, 'maintainer'::text, NULL::text[])$$,
    'the grant is recorded in idempotency.grants (re-applied by every migration)'
);
SELECT throws_ok(
    $$SELECT idempotency.grant_usage('idem_t41_other', kind => 'maintainer',
                                     scopes => ARRAY['a'])$$,
    'IK016', 'idempotency.grant_usage: argument "scopes" applies to kind ''completer'' only',
    'a maintainer has no scopes'
);
SELECT results_eq(
    $$SELECT p.oid::regprocedure FROM pg_proc AS p
      WHERE p.pronamespace = 'idempotency'::regnamespace
        AND has_function_privilege('idem_t41_maintainer', p.oid, 'EXECUTE')
      ORDER BY p.oid::regprocedure::text$$,
    $$SELECT signature FROM allowed_functions ORDER BY signature::text$$,
    'EXECUTE on maintain, (un)schedule_maintenance, the status reads and the three checks only'
);
SELECT results_eq(
    $$SELECT c.oid::regclass::text, p.privilege
      FROM pg_class AS c
      CROSS JOIN unnest(ARRAY['SELECT', 'INSERT', 'UPDATE', 'DELETE', 'TRUNCATE', 'REFERENCES',
                              'TRIGGER']) AS p (privilege)
      WHERE c.relnamespace = 'idempotency'::regnamespace AND c.relkind IN ('r', 'p', 'S')
        AND has_table_privilege('idem_t41_maintainer', c.oid, p.privilege)
      ORDER BY 1, 2$$,
    $$VALUES ('idempotency.maintenance_runs', 'SELECT'), ('idempotency.migrations', 'SELECT')$$,
    'SELECT on maintenance_runs and migrations, no other privilege on any table, partition or '
    || 'sequence'
);
SELECT is_empty(
    $$SELECT c.oid::regclass FROM pg_class AS c
      WHERE c.relnamespace = 'idempotency'::regnamespace
        -- CASE: the planner may test the privilege before the relkind otherwise.
        AND CASE WHEN c.relkind = 'S'
                 THEN has_sequence_privilege('idem_t41_maintainer', c.oid, 'USAGE, SELECT, UPDATE')
            END$$,
    'no privilege on any sequence'
);
SELECT ok(
    has_schema_privilege('idem_t41_maintainer', 'idempotency', 'USAGE')
    AND NOT has_schema_privilege('idem_t41_maintainer', 'idempotency', 'CREATE'),
    'USAGE on the schema, not CREATE'
);

CREATE TEMP TABLE runs_before ON COMMIT DROP AS
SELECT
    count(*) AS n,
    coalesce(max(id), 0) AS last_id
FROM idempotency.maintenance_runs;

-- Every other function refuses it, whatever its arguments -------------------------------------

-- Each function it may not execute, called as the maintainer with NULL arguments: the
-- privilege check comes before any argument is looked at, so each raises 42501. Each NULL is a
-- subquery: the planner folds a STRICT function of constant NULLs away, and its privilege
-- check with it.
CREATE FUNCTION pg_temp.refusals()
RETURNS TABLE (signature text, code text)
LANGUAGE plpgsql
AS $$
DECLARE
    v_fn record;
    v_call text;
BEGIN
    FOR v_fn IN
        SELECT p.oid, p.oid::regprocedure::text AS sig, p.proname, p.proargtypes
        FROM pg_proc AS p
        WHERE p.pronamespace = 'idempotency'::regnamespace
          AND p.oid NOT IN (SELECT a.signature FROM allowed_functions AS a)
        ORDER BY 2
    LOOP
        v_call := format(
            'SELECT idempotency.%I(%s)', v_fn.proname,
            coalesce((SELECT string_agg(format('(SELECT NULL::%s)', t::regtype), ', ' ORDER BY o)
                      FROM unnest(v_fn.proargtypes::oid[]) WITH ORDINALITY AS a (t, o)), ''));
        signature := v_fn.sig;
        BEGIN
            PERFORM pg_temp.as_maintainer(v_call);
            code := 'no error';
        EXCEPTION WHEN OTHERS THEN
            code := SQLSTATE;
        END;
        RETURN NEXT;
    END LOOP;
END;
$$;

CREATE TEMP TABLE refused ON COMMIT DROP AS SELECT * FROM pg_temp.refusals();

SELECT cmp_ok(
    (SELECT count(*) FROM refused), '>=', 70::bigint,
    'the catalog lists every other function of the schema (claim, complete, force_release, '
    || 'grant_usage, distribute, the internal ones ...)'
);
SELECT is_empty(
    $$SELECT signature, code FROM refused WHERE code <> '42501'$$,
    'every function of the schema but its own raises 42501 for the maintainer'
);
SELECT ok(
    (
        SELECT count(*) FROM refused
        WHERE
            signature LIKE any(ARRAY[
                'idempotency.claim(%', 'idempotency.complete(%',
                'idempotency.force_release(%', 'idempotency.grant_usage(%',
                'idempotency._reapply_grants(%', 'idempotency.takeover(%',
                'idempotency._create_partition(%', 'idempotency._maintain(%',
                'idempotency.list_keys(%', 'idempotency.inspect_key(%'
            ])
    ) = 10,
    'among them claim, complete, force_release, grant_usage, _reapply_grants, takeover, '
    || '_create_partition, _maintain, list_keys and inspect_key'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_maintainer('UPDATE idempotency.settings SET retention = ''1 hour''')$$,
    '42501', 'permission denied for table settings',
    'it cannot change the settings'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_maintainer('DELETE FROM idempotency.maintenance_runs')$$,
    '42501', 'permission denied for table maintenance_runs',
    'it cannot rewrite the maintenance history it reads'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_maintainer(
        'INSERT INTO idempotency.grants (grantee, kind) VALUES (''idem_t41_other'', ''request'')')$$,
    '42501', 'permission denied for table grants',
    'it cannot record a grant'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_maintainer('SELECT count(*) FROM idempotency.keys')$$,
    '42501', 'permission denied for table keys',
    'it cannot read the keys (nor their stored responses)'
);

-- The clock is the owner's ---------------------------------------------------------------------

SELECT throws_ok(
    $$SELECT pg_temp.as_maintainer(
        'SELECT count(*) FROM idempotency.maintain(now() - interval ''1 hour'')')$$,
    'IK017', 'idempotency.maintain: argument "reference_time" may be passed only by the owner '
    || 'of schema idempotency',
    'a past reference_time (early tombstone expiry) is the owner''s test clock'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_maintainer(
        'SELECT count(*) FROM idempotency.maintain(now() + interval ''1 day'')')$$,
    'IK017', NULL,
    'so is a future one'
);
SELECT is(
    (SELECT count(*) FROM idempotency.maintenance_runs), (SELECT n FROM runs_before),
    'the refused runs recorded nothing'
);

-- What it may do -------------------------------------------------------------------------------

-- A partition six days old with one completed key, due for a drop (retention is 24 hours), and
-- a key claimed now beside it, since maintain() never drops the newest interval holding rows.
CREATE TEMP TABLE old_part ON COMMIT DROP AS
SELECT date_bin('1 day', now() - interval '6 days', timestamptz '2000-01-01 00:00:00+00') AS lo;
SELECT idempotency.claim('t41', 'now', '{}');
SELECT idempotency._create_partition('keys', lo, lo + interval '1 day') FROM old_part;
SELECT idempotency.complete(
    't41', 'old',
    (
        SELECT c.lease_token FROM old_part AS o
        CROSS JOIN LATERAL idempotency.claim('t41', 'old', '{}', reference_time => o.lo) AS c
    ),
    200, '{}', reference_time => (SELECT lo + interval '1 second' FROM old_part)
);
CREATE TEMP TABLE old_name ON COMMIT DROP AS
SELECT tableoid::regclass::text AS name FROM idempotency.keys
WHERE scope = 't41' AND key = 'old';

SELECT is(
    pg_temp.as_maintainer(format(
        $$SELECT count(*) FROM idempotency.maintain()
          WHERE action = 'dropped' AND partition_name = %L$$,
        (SELECT replace(name, 'idempotency.', '') FROM old_name)
    )),
    '1',
    'it runs maintain() at the clock, which drops the expired partition'
);
SELECT ok(
    to_regclass((SELECT name FROM old_name)) IS NULL
    AND NOT EXISTS (
        SELECT FROM idempotency.keys
        WHERE scope = 't41' AND key = 'old'
    )
    AND EXISTS (
        SELECT FROM idempotency.keys
        WHERE scope = 't41' AND key = 'now'
    ),
    'the expired partition and its key are gone, the young key stays'
);
SELECT lives_ok(
    $$SELECT pg_temp.as_maintainer(
        'SELECT count(*) FROM idempotency.maintain(reference_time => now())')$$,
    'reference_time => now() is the clock, and allowed (pg-idempotency maintain passes it)'
);
SELECT is(
    pg_temp.as_maintainer(
        format($$SELECT string_agg(outcome, ',' ORDER BY id) FROM idempotency.maintenance_runs
                 WHERE id > %s$$, (SELECT last_id FROM runs_before))
    ),
    'ok,ok',
    'it reads maintenance_runs, where its runs are recorded'
);
SELECT is(
    pg_temp.as_maintainer(
        $$SELECT keys FROM idempotency.key_status() WHERE scope = 't41'$$
    ),
    '1',
    'it reads key_status (pg-idempotency status)'
);
SELECT is(
    pg_temp.as_maintainer(
        $$SELECT count(*) > 0 FROM idempotency.partition_status() WHERE parent_table = 'keys'$$
    ),
    'true',
    'it reads partition_status (pg-idempotency status)'
);
SELECT is(
    pg_temp.as_maintainer(
        $$SELECT (m.keys_in_progress, m.maintain_last_outcome)::text
          FROM idempotency.metrics() AS m$$
    ),
    '(1,ok)',
    'it reads metrics'
);
SELECT is(
    pg_temp.as_maintainer(
        $$SELECT max(version) >= 13 FROM idempotency.migrations$$
    ),
    'true',
    'it reads the schema version (what pg-idempotency checks before maintain and status)'
);

SELECT * FROM finish();

ROLLBACK;
