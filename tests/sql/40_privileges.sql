-- Privileges and function attributes: PUBLIC gets nothing; grant_usage() lets an application
-- role call the public functions and nothing else; every function pins its search_path (except
-- the documented inlinable helpers), has a comment, its intended volatility, and SECURITY
-- DEFINER exactly where an application role needs it.
--
-- The roles are created in this transaction and roll back with it. pgTAP records results in
-- temp tables that an application role may not write, so each call "as" a role goes through
-- pg_temp.as_role(), which runs one statement under SET LOCAL ROLE and switches back; when the
-- statement fails, the error unwinds the subtransaction of throws_ok() and the role with it.
BEGIN;

SELECT plan(86);

CREATE ROLE idem_t40_app NOLOGIN;
CREATE ROLE idem_t40_usage_only NOLOGIN;
CREATE ROLE idem_t40_request NOLOGIN;
CREATE ROLE idem_t40_completer NOLOGIN;
GRANT USAGE ON SCHEMA idempotency TO idem_t40_usage_only;

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

-- as_app(sql): as_role for the application role.
CREATE FUNCTION pg_temp.as_app(sql text)
RETURNS text
LANGUAGE sql
AS $$ SELECT pg_temp.as_role('idem_t40_app', sql) $$;

-- The daily partition of parent made at install time (idempotency.migrations.applied_at).
CREATE FUNCTION pg_temp.install_partition(parent text)
RETURNS text
LANGUAGE sql
STABLE
AS $$
    SELECT format('idempotency.%I', idempotency._partition_name(
        parent,
        date_bin('1 day', m.applied_at, timestamptz '2000-01-01 00:00:00+00'),
        interval '1 day'))
    FROM idempotency.migrations AS m WHERE m.version = 1
$$;

-- PUBLIC has no privilege at all ---------------------------------------------------------------

SELECT cmp_ok(
    (
        SELECT count(*) FROM pg_class AS c
        WHERE c.relnamespace = 'idempotency'::regnamespace AND c.relkind IN ('r', 'p', 'S')
    ),
    '>=', 15::bigint,
    'the checks below see the tables and partitions'
);
SELECT results_eq(
    $$SELECT c.oid::regclass::text FROM pg_class AS c
      WHERE c.relnamespace = 'idempotency'::regnamespace AND c.relkind = 'S'$$,
    $$VALUES ('idempotency.maintenance_runs_id_seq')$$,
    'no sequence in the schema but the identity of maintenance_runs (since 0.9.0 lease tokens '
    || 'are made per key by _new_token)'
);
SELECT is_empty(
    $$SELECT c.oid::regclass FROM pg_class AS c CROSS JOIN LATERAL aclexplode(c.relacl) AS a
      WHERE c.relnamespace = 'idempotency'::regnamespace AND a.grantee = 0$$,
    'no ACL entry for PUBLIC on any table, partition or sequence of the schema'
);
SELECT is_empty(
    $$SELECT c.oid::regclass FROM pg_class AS c
      WHERE c.relnamespace = 'idempotency'::regnamespace AND c.relkind IN ('r', 'p')
        AND has_table_privilege(
            'public', c.oid, 'SELECT, INSERT, UPDATE, DELETE, TRUNCATE, REFERENCES, TRIGGER')$$,
    'PUBLIC has no privilege on any table or partition'
);
SELECT ok(
    NOT has_function_privilege('public', 'idempotency._new_token(bigint)', 'EXECUTE'),
    'PUBLIC cannot make lease tokens (idempotency._new_token)'
);
SELECT ok(
    NOT has_schema_privilege('public', 'idempotency', 'USAGE, CREATE'),
    'PUBLIC has no privilege on schema idempotency'
);
SELECT is_empty(
    $$SELECT p.oid::regprocedure FROM pg_proc AS p
      WHERE p.pronamespace = 'idempotency'::regnamespace
        AND has_function_privilege('public', p.oid, 'EXECUTE')$$,
    'PUBLIC cannot execute any function of the schema'
);

-- Before grant_usage ---------------------------------------------------------------------------

SELECT throws_ok(
    $$SELECT pg_temp.as_app('SELECT idempotency.claim(''p'', ''k'', ''{}'')')$$,
    '42501', 'permission denied for schema idempotency',
    'before grant_usage: claim is refused (no usage on the schema)'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_app('SELECT idempotency.fingerprint(''{}'')')$$,
    '42501', NULL,
    'before grant_usage: fingerprint is refused'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_role('idem_t40_usage_only',
                             'SELECT idempotency.claim(''p'', ''k'', ''{}'')')$$,
    '42501', 'permission denied for function claim',
    'usage on the schema alone does not allow claim'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_role('idem_t40_usage_only', 'SELECT count(*) FROM idempotency.keys')$$,
    '42501', 'permission denied for table keys',
    'usage on the schema alone does not allow reading keys'
);
SELECT is_empty(
    $$SELECT FROM idempotency.keys WHERE scope = 'p'$$,
    'the refused calls wrote nothing'
);

-- grant_usage ----------------------------------------------------------------------------------

SELECT lives_ok(
    $$SELECT idempotency.grant_usage('idem_t40_app'),
             idempotency.grant_usage('idem_t40_app', kind => 'completer'),
             idempotency.grant_usage('idem_t40_request', kind => 'request'),
             idempotency.grant_usage('idem_t40_completer', kind => 'completer')$$,
    'grant_usage(idem_t40_app) of both kinds, and one role of each kind'
);
SELECT results_eq(
    $$SELECT p.proname::text COLLATE "default" FROM pg_proc AS p
      WHERE p.pronamespace = 'idempotency'::regnamespace
        AND has_function_privilege('idem_t40_request', p.oid, 'EXECUTE')
      ORDER BY 1$$,
    $$VALUES ('accept'), ('canonical_json'), ('checkpoint'), ('checkpoint_outcome'), ('claim'),
             ('complete'), ('complete_bytes'), ('derive_key'), ('fingerprint'), ('heartbeat'),
             ('heartbeat_outcome'), ('inbox_accept'), ('release'), ('release_outcome')$$,
    'grant_usage(kind => request): claim, inbox_accept, the fenced calls and the pure helpers'
);
SELECT results_eq(
    $$SELECT p.proname::text COLLATE "default" FROM pg_proc AS p
      WHERE p.pronamespace = 'idempotency'::regnamespace
        AND has_function_privilege('idem_t40_completer', p.oid, 'EXECUTE')
      ORDER BY 1$$,
    $$VALUES ('accept'), ('canonical_json'), ('checkpoint'), ('checkpoint_outcome'),
             ('complete'), ('complete_bytes'), ('derive_key'), ('fingerprint'), ('heartbeat'),
             ('heartbeat_outcome'), ('list_abandoned'), ('release'), ('release_outcome'),
             ('takeover')$$,
    'grant_usage(kind => completer): takeover, list_abandoned, the fenced calls and the pure '
    || 'helpers'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_role('idem_t40_request',
                             'SELECT (idempotency.takeover(''p'', ''k'')).outcome')$$,
    '42501', 'permission denied for function takeover',
    'request role: takeover is refused'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_role('idem_t40_request',
                             'SELECT count(*) FROM idempotency.list_abandoned()')$$,
    '42501', 'permission denied for function list_abandoned',
    'request role: list_abandoned is refused'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_role('idem_t40_completer',
                             'SELECT (idempotency.claim(''p'', ''k'', ''{}'')).outcome')$$,
    '42501', 'permission denied for function claim',
    'completer role: claim is refused'
);
SELECT ok(
    has_schema_privilege('idem_t40_app', 'idempotency', 'USAGE')
    AND NOT has_schema_privilege('idem_t40_app', 'idempotency', 'CREATE'),
    'grant_usage gives USAGE on the schema, not CREATE'
);
SELECT results_eq(
    $$SELECT p.proname::text COLLATE "default" FROM pg_proc AS p
      WHERE p.pronamespace = 'idempotency'::regnamespace
        AND has_function_privilege('idem_t40_app', p.oid, 'EXECUTE')
      ORDER BY 1$$,
    $$VALUES ('accept'), ('canonical_json'), ('checkpoint'), ('checkpoint_outcome'), ('claim'),
             ('complete'), ('complete_bytes'), ('derive_key'), ('fingerprint'), ('heartbeat'),
             ('heartbeat_outcome'), ('inbox_accept'), ('list_abandoned'), ('release'),
             ('release_outcome'), ('takeover')$$,
    'grant_usage: EXECUTE on the public functions only, no internal one'
);
SELECT is_empty(
    $$SELECT c.oid::regclass FROM pg_class AS c
      WHERE c.relnamespace = 'idempotency'::regnamespace AND c.relkind IN ('r', 'p')
        AND has_table_privilege(
            'idem_t40_app', c.oid,
            'SELECT, INSERT, UPDATE, DELETE, TRUNCATE, REFERENCES, TRIGGER')$$,
    'grant_usage: no privilege on any table or partition'
);
SELECT ok(
    NOT has_function_privilege('idem_t40_app', 'idempotency._new_token(bigint)', 'EXECUTE')
    AND NOT has_function_privilege(
        'idem_t40_app', 'idempotency.distribute(integer, boolean)', 'EXECUTE'
    ),
    'grant_usage: no privilege on _new_token, nor on distribute (the owner''s)'
);

-- After grant_usage, the application role uses the engine -------------------------------------

CREATE TEMP TABLE tok ON COMMIT DROP AS
SELECT
    pg_temp.as_app(
        $$SELECT (idempotency.claim('p', 'k1', '{"a": 1}')).lease_token$$
    )::bigint AS k1,
    pg_temp.as_app(
        $$SELECT (idempotency.claim('p', 'k2', '{"a": 2}')).lease_token$$
    )::bigint AS k2,
    pg_temp.as_app(
        $$SELECT (idempotency.claim('p', 'k3', '{"a": 3}')).lease_token$$
    )::bigint AS k3,
    pg_temp.as_app(
        $$SELECT (idempotency.claim('p', 'k4', '{"a": 4}', lease => '1 second')).lease_token$$
    )::bigint AS k4;

SELECT is_empty(
    $$SELECT FROM idempotency.keys WHERE scope = 'p' AND state <> 'in_progress'$$,
    'app role: claim made in-progress keys'
);
SELECT results_eq(
    $$SELECT k.key, k.lease_token FROM idempotency.keys AS k WHERE k.scope = 'p' ORDER BY k.key$$,
    $$SELECT * FROM (VALUES ('k1'::text, (SELECT k1 FROM tok)), ('k2', (SELECT k2 FROM tok)),
                            ('k3', (SELECT k3 FROM tok)), ('k4', (SELECT k4 FROM tok))) AS v$$,
    'app role: claim returned each key''s lease token'
);
SELECT is(
    pg_temp.as_app(
        $$SELECT (idempotency.claim('p', 'k1', '{"a": 1}')).outcome$$
    ),
    'in_progress',
    'app role: a second claim sees in_progress'
);
SELECT is(
    pg_temp.as_app(format(
        $$SELECT idempotency.checkpoint('p', 'k1', %s, 'rp-1')$$,
        (SELECT k1 FROM tok)
    ))::timestamptz
    <@ tstzrange(now() + interval '30 seconds', clock_timestamp() + interval '30 seconds', '[]'),
    true,
    'app role: checkpoint'
);
SELECT is(
    pg_temp.as_app(format(
        $$SELECT idempotency.heartbeat('p', 'k1', %s, '1 minute')$$,
        (SELECT k1 FROM tok)
    ))::timestamptz
    <@ tstzrange(now() + interval '1 minute', clock_timestamp() + interval '1 minute', '[]'),
    true,
    'app role: heartbeat'
);
SELECT is(
    pg_temp.as_app(format(
        $$SELECT idempotency.complete('p', 'k1', %s, 201, '{"id": 1}')$$,
        (SELECT k1 FROM tok)
    ))::timestamptz
    <@ tstzrange(now(), clock_timestamp(), '[]'),
    true,
    'app role: complete'
);
SELECT is(
    pg_temp.as_app(format(
        $$SELECT idempotency.complete_bytes('p', 'k2', %s, 200, '\x01'::bytea, 'a/b')$$,
        (SELECT k2 FROM tok)
    ))::timestamptz
    <@ tstzrange(now(), clock_timestamp(), '[]'),
    true,
    'app role: complete_bytes'
);
SELECT lives_ok(
    format(
        $$SELECT pg_temp.as_app('SELECT idempotency.release(''p'', ''k3'', %s)')$$,
        (SELECT k3 FROM tok)
    ),
    'app role: release'
);
SELECT results_eq(
    $$SELECT key, state, recovery_point, response_status FROM idempotency.keys
      WHERE scope = 'p' ORDER BY key$$,
    $$VALUES ('k1'::text, 'completed'::text, 'rp-1'::text, 201), ('k2', 'completed', NULL, 200),
             ('k3', 'released', NULL, NULL), ('k4', 'in_progress', NULL, NULL)$$,
    'app role: the effects of checkpoint, complete, complete_bytes and release are stored'
);
SELECT is(
    pg_temp.as_app(
        $$SELECT (idempotency.claim('p', 'k1', '{"a": 1}'))
                 .response_body::text$$
    ),
    '{"id": 1}',
    'app role: claim replays'
);
SELECT is(
    pg_temp.as_app(
        $$SELECT (idempotency.takeover('p', 'k1')).outcome$$
    ),
    'replay',
    'app role: takeover of a completed key'
);
-- k4's lease of 1 second runs out (reference_time is not the application role's to move).
SELECT pg_sleep(1.1);
SELECT is(
    pg_temp.as_app(
        $$SELECT string_agg(key, ',') FROM idempotency.list_abandoned(scope => 'p')$$
    ),
    'k4',
    'app role: list_abandoned'
);
SELECT is(
    pg_temp.as_app(
        $$SELECT (idempotency.takeover('p', 'k4')).outcome$$
    ),
    'resumed',
    'app role: takeover of an expired key'
);
SELECT is(
    pg_temp.as_app($$SELECT idempotency.inbox_accept('p-consumer', 'm-1')$$),
    'true',
    'app role: inbox_accept, first delivery'
);
SELECT is(
    pg_temp.as_app($$SELECT idempotency.inbox_accept('p-consumer', 'm-1')$$),
    'false',
    'app role: inbox_accept, redelivery'
);
SELECT is(
    pg_temp.as_app($$SELECT encode(idempotency.fingerprint('{"b": 1, "a": [1.0]}'), 'hex')$$),
    encode(idempotency.fingerprint('{"a": [1], "b": 1}'), 'hex'),
    'app role: fingerprint'
);
SELECT is(
    pg_temp.as_app($$SELECT idempotency.canonical_json('{"b": 1, "a": [1.0]}')$$),
    '{"a":[1],"b":1}',
    'app role: canonical_json'
);
SELECT is(
    pg_temp.as_app($$SELECT idempotency.derive_key('p', 'k1', 'charge')$$),
    idempotency.derive_key('p', 'k1', 'charge'),
    'app role: derive_key'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_app('SELECT idempotency.fingerprint(NULL)')$$,
    'IK010', 'idempotency.fingerprint: argument "request" must not be NULL',
    'app role: a bad fingerprint argument is IK010, not 42501'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_app('SELECT idempotency.derive_key(''p'', ''k'', '''')')$$,
    'IK011', 'idempotency.derive_key: argument "step" must not be empty',
    'app role: a bad derive_key argument is IK011, not 42501'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_app('SELECT idempotency.fingerprint(''[1]'', fields => ARRAY[''a''])')$$,
    'IK015', NULL,
    'app role: a fingerprint of the wrong JSON type is IK015, not 42501'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_app('SELECT idempotency.claim(''p'', '''', ''{}'')')$$,
    'IK011', NULL,
    'app role: a bad claim argument is IK011'
);

-- ... and nothing else -------------------------------------------------------------------------

SELECT throws_ok(
    $$SELECT pg_temp.as_app('SELECT count(*) FROM idempotency.keys')$$,
    '42501', 'permission denied for table keys',
    'app role: SELECT on idempotency.keys is refused'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_app('INSERT INTO idempotency.keys (scope, key, fingerprint, state,
        lease_token, created_at) VALUES (''p'', ''x'', ''\x00'', ''completed'', 1, now())')$$,
    '42501', 'permission denied for table keys',
    'app role: INSERT into idempotency.keys is refused'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_app('UPDATE idempotency.keys SET attempts = 0')$$,
    '42501', 'permission denied for table keys',
    'app role: UPDATE of idempotency.keys is refused'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_app('DELETE FROM idempotency.keys')$$,
    '42501', 'permission denied for table keys',
    'app role: DELETE from idempotency.keys is refused'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_app('TRUNCATE idempotency.keys')$$,
    '42501', 'permission denied for table keys',
    'app role: TRUNCATE of idempotency.keys is refused'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_app('SELECT count(*) FROM idempotency.inbox')$$,
    '42501', 'permission denied for table inbox',
    'app role: SELECT on idempotency.inbox is refused'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_app('INSERT INTO idempotency.inbox VALUES (''c'', ''m'', now())')$$,
    '42501', 'permission denied for table inbox',
    'app role: INSERT into idempotency.inbox is refused'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_app('UPDATE idempotency.inbox SET message_id = ''x''')$$,
    '42501', 'permission denied for table inbox',
    'app role: UPDATE of idempotency.inbox is refused'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_app('DELETE FROM idempotency.inbox')$$,
    '42501', 'permission denied for table inbox',
    'app role: DELETE from idempotency.inbox is refused'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_app('SELECT premake FROM idempotency.settings')$$,
    '42501', 'permission denied for table settings',
    'app role: SELECT on idempotency.settings is refused'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_app('INSERT INTO idempotency.settings DEFAULT VALUES')$$,
    '42501', 'permission denied for table settings',
    'app role: INSERT into idempotency.settings is refused'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_app('UPDATE idempotency.settings SET premake = 366')$$,
    '42501', 'permission denied for table settings',
    'app role: UPDATE of idempotency.settings is refused'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_app('DELETE FROM idempotency.settings')$$,
    '42501', 'permission denied for table settings',
    'app role: DELETE from idempotency.settings is refused'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_app('SELECT count(*) FROM idempotency.migrations')$$,
    '42501', 'permission denied for table migrations',
    'app role: SELECT on idempotency.migrations is refused'
);
SELECT ok(
    to_regclass(pg_temp.install_partition('keys')) IS NOT NULL
    AND to_regclass(pg_temp.install_partition('inbox')) IS NOT NULL,
    'the install-time partitions exist'
);
SELECT throws_ok(
    format(
        'SELECT pg_temp.as_app(%L)', 'SELECT count(*) FROM ' || pg_temp.install_partition('keys')
    ),
    '42501', NULL,
    'app role: SELECT on a keys partition is refused'
);
SELECT throws_ok(
    format('SELECT pg_temp.as_app(%L)', 'DELETE FROM ' || pg_temp.install_partition('keys')),
    '42501', NULL,
    'app role: DELETE from a keys partition is refused'
);
SELECT throws_ok(
    format(
        'SELECT pg_temp.as_app(%L)',
        'UPDATE ' || pg_temp.install_partition('keys') || ' SET attempts = 0'
    ),
    '42501', NULL,
    'app role: UPDATE of a keys partition is refused'
);
SELECT throws_ok(
    format(
        'SELECT pg_temp.as_app(%L)', 'SELECT count(*) FROM ' || pg_temp.install_partition('inbox')
    ),
    '42501', NULL,
    'app role: SELECT on an inbox partition is refused'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_app('SELECT count(*) FROM idempotency.keys_default')$$,
    '42501', 'permission denied for table keys_default',
    'app role: SELECT on idempotency.keys_default is refused'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_app('DELETE FROM idempotency.inbox_default')$$,
    '42501', 'permission denied for table inbox_default',
    'app role: DELETE from idempotency.inbox_default is refused'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_app('SELECT idempotency._new_token(NULL)')$$,
    '42501', 'permission denied for function _new_token',
    'app role: _new_token (which makes lease tokens) is refused'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_app('SELECT count(*) FROM idempotency.distribute()')$$,
    '42501', 'permission denied for function distribute',
    'app role: distribute is refused'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_app('SELECT idempotency._premake(now())')$$,
    '42501', 'permission denied for function _premake',
    'app role: _premake is refused'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_app('SELECT idempotency._create_partition(''keys'',
        ''2001-01-01 00:00+00'', ''2001-01-02 00:00+00'')')$$,
    '42501', 'permission denied for function _create_partition',
    'app role: _create_partition is refused'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_app('SELECT idempotency._complete_row(''p'', ''k2'', 1, NULL, 200,
        ''{}'', NULL, NULL, NULL, now())')$$,
    '42501', 'permission denied for function _complete_row',
    'app role: _complete_row (the route of complete, whose errors complete raises) is refused'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_app('SELECT idempotency._drop_directory_rows(''keys'', ''keys'', now())')$$,
    '42501', 'permission denied for function _drop_directory_rows',
    'app role: _drop_directory_rows is refused'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_app('SELECT idempotency._name_ok(''a'')')$$,
    '42501', 'permission denied for function _name_ok',
    'app role: _name_ok is refused'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_app('SELECT idempotency._lease_error(''f'', ''p'', ''k1'', 1)')$$,
    '42501', 'permission denied for function _lease_error',
    'app role: _lease_error is refused'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_app('SELECT idempotency.grant_usage(''idem_t40_usage_only'')')$$,
    '42501', 'permission denied for function grant_usage',
    'app role: grant_usage is refused'
);
SELECT throws_ok(
    $$SELECT pg_temp.as_app('CREATE TABLE idempotency.evil (a int)')$$,
    '42501', 'permission denied for schema idempotency',
    'app role: cannot create objects in the schema'
);
SELECT results_eq(
    $$SELECT key, state FROM idempotency.keys WHERE scope = 'p' ORDER BY key$$,
    $$VALUES ('k1'::text, 'completed'::text), ('k2', 'completed'), ('k3', 'released'),
             ('k4', 'in_progress')$$,
    'the refused statements changed nothing'
);
SELECT is(
    current_user::text, session_user::text,
    'as_role always switched back to the owner'
);

-- Function attributes --------------------------------------------------------------------------

SELECT results_eq(
    $$SELECT p.proname::text COLLATE "default" FROM pg_proc AS p
      WHERE p.pronamespace = 'idempotency'::regnamespace AND p.proconfig IS NULL
      ORDER BY 1$$,
    $$VALUES ('_accept_row'), ('_checkpoint_row'), ('_claim_row_local'), ('_complete_row'),
             ('_drop_released_row'), ('_headers_ok'), ('_heartbeat_row'), ('_key_row'),
             ('_lease_ok'), ('_local_shards'), ('_name_ok'), ('_new_token'),
             ('_partition_origin'), ('_partition_start'), ('_raw_size'), ('_release_row'),
             ('_resume_row')$$,
    'every function pins search_path except the inlinable helpers and the generated routes '
    || '(called only from functions that pin it; see _make_routes; _claim_row_local is the '
    || 'single-server stub of one)'
);
-- The functions that turn partition bounds into text also pin DateStyle and TimeZone, so what
-- they read does not depend on the caller's session (migration 0004).
SELECT is_empty(
    $$SELECT p.oid::regprocedure FROM pg_proc AS p
      WHERE p.pronamespace = 'idempotency'::regnamespace AND p.proconfig IS NOT NULL
        AND p.proconfig <> ARRAY['search_path=pg_catalog, pg_temp']
        AND NOT (p.proname IN ('_partitions', '_create_partition', '_make_routes',
                               '_route_branches')
                 AND p.proconfig = ARRAY['search_path=pg_catalog, pg_temp',
                                         'DateStyle=ISO, YMD', 'TimeZone=UTC'])
        AND NOT (p.proname IN ('claim', '_resume_existing', 'heartbeat',
                               'checkpoint', 'accept', 'release', 'takeover', '_lease_outcome',
                               'heartbeat_outcome', 'checkpoint_outcome', 'release_outcome')
                 AND p.proconfig = ARRAY['search_path=pg_catalog, pg_temp',
                                         'plan_cache_mode=force_generic_plan'])$$,
    'the pinned search_path is exactly pg_catalog, pg_temp (and DateStyle ISO, TimeZone UTC '
    || 'where bounds become text, generic plans where a key''s partition is addressed; '
    || 'nothing else is set)'
);
SELECT results_eq(
    $$SELECT p.proname::text COLLATE "default", l.lanname::text COLLATE "default" FROM pg_proc AS p
      INNER JOIN pg_language AS l ON p.prolang = l.oid
      WHERE p.pronamespace = 'idempotency'::regnamespace
        AND p.proname IN ('_headers_ok', '_lease_ok', '_local_shards', '_name_ok', '_new_token',
                          '_partition_origin', '_partition_start', '_raw_size')
      ORDER BY 1$$,
    $$VALUES ('_headers_ok', 'sql'), ('_lease_ok', 'sql'), ('_local_shards', 'sql'),
             ('_name_ok', 'sql'), ('_new_token', 'sql'), ('_partition_origin', 'sql'),
             ('_partition_start', 'sql'), ('_raw_size', 'sql')$$,
    'the helpers without search_path are SQL functions (the only kind that can be inlined)'
);
SELECT is_empty(
    $$SELECT p.oid::regprocedure FROM pg_proc AS p
      WHERE p.pronamespace = 'idempotency'::regnamespace
        AND p.proname IN ('_headers_ok', '_lease_ok', '_local_shards', '_name_ok', '_new_token',
                          '_partition_origin', '_partition_start', '_raw_size')
        AND (p.prosecdef OR p.proisstrict)$$,
    'the inlinable helpers are neither SECURITY DEFINER nor STRICT (either would stop inlining)'
);
SELECT is_empty(
    $$SELECT p.oid::regprocedure FROM pg_proc AS p
      WHERE p.pronamespace = 'idempotency'::regnamespace
        AND coalesce(obj_description(p.oid, 'pg_proc'), '') = ''$$,
    'every function has a COMMENT'
);
SELECT is_empty(
    $$SELECT c.oid::regclass FROM pg_class AS c
      WHERE c.relnamespace = 'idempotency'::regnamespace AND c.relkind IN ('r', 'p', 'S')
        AND NOT c.relispartition AND coalesce(obj_description(c.oid, 'pg_class'), '') = ''$$,
    'every table and sequence (partitions aside) has a COMMENT'
);
SELECT results_eq(
    $$SELECT p.proname::text COLLATE "default", p.provolatile::text FROM pg_proc AS p
      WHERE p.pronamespace = 'idempotency'::regnamespace ORDER BY 1$$,
    $$VALUES
        ('_accept_row', 'v'), ('_canonical_json', 's'), ('_canonical_number', 'i'),
        ('_check_headers', 'i'),
        ('_check_lease', 'i'), ('_check_name', 'i'), ('_check_response', 'i'),
        ('_check_size', 's'), ('_check_time', 'i'),
        ('_checkpoint_row', 'v'), ('_citus_custom_plans', 'v'), ('_claim_row_local', 'v'),
        ('_complete_row', 'v'), ('_completer_scopes', 's'),
        ('_create_partition', 'v'), ('_distributed', 's'), ('_drop_directory_rows', 'v'),
        ('_drop_released_row', 'v'),
        ('_headers_ok', 'i'), ('_heartbeat_row', 'v'),
        ('_invalid_argument', 'v'), ('_keep_from', 's'), ('_key_hash', 'i'), ('_key_row', 'v'),
        ('_lease_error', 's'),
        ('_lease_ok', 'i'), ('_lease_outcome', 's'), ('_legacy_fingerprint', 's'),
        ('_local_shards', 'i'), ('_maintain', 'v'),
        ('_make_partitions', 'v'),
        ('_make_routes', 'v'), ('_mirror_completer_grants', 'v'),
        ('_name_ok', 'i'), ('_new_token', 'v'),
        ('_partition_name', 'i'), ('_partition_origin', 'i'), ('_partition_start', 'i'),
        ('_partitions', 's'), ('_premake', 'v'), ('_raw_size', 's'),
        ('_reapply_grants', 'v'), ('_recreate_function', 'v'), ('_release_row', 'v'),
        ('_require_coordinator', 's'), ('_require_pg_cron', 's'),
        ('_require_read_committed', 's'), ('_resume_existing', 'v'),
        ('_resume_row', 'v'), ('_route_branches', 'i'), ('_shard_branches', 'i'),
        ('_test_clock', 's'), ('_write_tombstones', 'v'), ('accept', 'v'), ('canonical_json', 's'),
        ('checkpoint', 'v'), ('checkpoint_outcome', 'v'), ('claim', 'v'), ('complete', 'v'),
        ('complete_bytes', 'v'),
        ('derive_key', 'i'), ('distribute', 'v'), ('fingerprint', 's'), ('force_release', 'v'),
        ('grant_usage', 'v'), ('heartbeat', 'v'), ('heartbeat_outcome', 'v'), ('inbox_accept', 'v'),
        ('inspect_key', 's'),
        ('key_status', 'v'), ('list_abandoned', 'v'), ('list_keys', 's'), ('maintain', 'v'),
        ('metrics', 'v'), ('metrics_by_scope', 'v'), ('partition_status', 'v'), ('release', 'v'),
        ('release_outcome', 'v'), ('schedule_maintenance', 'v'),
        ('takeover', 'v'), ('unschedule_maintenance', 'v')$$,
    'every function has its intended volatility (pure: immutable; reads: stable; writes, '
    || 'locks or always raises: volatile)'
);
SELECT results_eq(
    $$SELECT p.proname::text COLLATE "default" FROM pg_proc AS p
      WHERE p.pronamespace = 'idempotency'::regnamespace AND p.prosecdef ORDER BY 1$$,
    $$VALUES ('accept'), ('canonical_json'), ('checkpoint'), ('checkpoint_outcome'), ('claim'),
             ('complete'), ('complete_bytes'), ('derive_key'), ('fingerprint'), ('heartbeat'),
             ('heartbeat_outcome'), ('inbox_accept'), ('key_status'), ('list_abandoned'),
             ('maintain'), ('metrics'), ('metrics_by_scope'), ('partition_status'), ('release'),
             ('release_outcome'), ('takeover')$$,
    'SECURITY DEFINER exactly on the lifecycle functions (and the three pure ones that call '
    || 'internal helpers), the monitor''s metrics and the maintainer''s maintain and status reads'
);
SELECT is_empty(
    $$SELECT p.oid::regprocedure FROM pg_proc AS p
      WHERE p.pronamespace = 'idempotency'::regnamespace AND p.prosecdef
        AND NOT coalesce(p.proconfig @> ARRAY['search_path=pg_catalog, pg_temp'], false)$$,
    'every SECURITY DEFINER function pins search_path to pg_catalog, pg_temp'
);

SELECT * FROM finish();

ROLLBACK;
