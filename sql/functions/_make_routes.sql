-- Generates the routed statements of the lifecycle, so that they touch one plain partition of
-- idempotency.keys instead of the partitioned parent:
--
--   _key_row(scope, key, created_at)         the key's row (claim's replay/in-progress/mismatch)
--   _complete_row(scope, key, token, ...)    complete()'s and complete_bytes()' fenced UPDATE
--   _heartbeat_row, _checkpoint_row,         the fenced UPDATE of heartbeat(), checkpoint(),
--   _accept_row, _release_row                accept() and release()
--   _resume_row                              the takeover of an expired lease (claim, takeover)
--   _drop_released_row                       claim()'s removal of a released key's row
--
-- Why generate code: a statement on the parent, even with a generic plan that prunes at executor
-- startup, locks every partition the plan names (PostgreSQL 15 to 18), so its cost grows with
-- the number of partitions. Dynamic SQL on the partition avoids the locks but plans on every
-- call. A static statement per partition, chosen by an IF on created_at, has a
-- cached plan on a plain table and locks one table: flat in the number of partitions.
--
-- The generated functions are a cache of the catalog, never the truth, so staleness is harmless:
-- - a partition made after the last generation (pg_partman, by hand) has no branch: its keys go
--   through the statement on the parent, which is always there last;
-- - a branch whose partition is gone (dropped by pg_partman, or by maintain() in a transaction
--   that committed after the caller compiled the function) is skipped by its to_regclass()
--   test. The generated function locks the parent idempotency.keys before that test, and every
--   DROP or DETACH of a partition locks the parent exclusively, so the test cannot pass for a
--   partition dropped before the branch's statement runs;
-- - a branch that finds no row falls through to the parent, so a row in a partition the branch
--   did not expect (or the default partition) is still found. Only failures pay for that.
--
-- A route may also have a guess: a statement run first, when the caller passes created_at NULL,
-- on the partition that holds another of its arguments (without partitions to branch on, as on
-- Citus: on the parent, for a key created in the hour up to that argument and in its
-- partition), without reading
-- key_directory. Only _complete_row has one: complete() comes within a lease of the claim, so
-- the key's row is nearly always in the partition of the completion's own time, and the
-- directory read it saves is a sizeable part of complete's work (docs/design.md, "Routing to
-- one partition").
-- A wrong guess (a complete after a takeover days later, or across midnight) matches no row,
-- and the route reads created_at from key_directory and goes on as any route: correct either
-- way, since (scope, key) has one row in all the partitions (key_directory's primary key) and
-- the guess compares the token as every fenced statement does.
--
-- Called by _create_partition (when it makes a partition of keys) and at the end of maintain();
-- it replaces a function only when the text changes, since every replacement makes each session
-- compile the function again on its next call.
CREATE FUNCTION idempotency._make_routes()
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
-- The bounds become literals in the generated text: ISO with a numeric UTC offset, which reads
-- back as the same instant under any DateStyle and TimeZone of the sessions that run it.
SET datestyle = 'ISO, YMD'
SET timezone = 'UTC'
AS $make$
DECLARE
    -- One row per generated function: its name, its parameters, what it returns (held in
    -- v_done), its statement, in which @table@ is the table addressed (a partition, then the
    -- parent as the last word) and @fn@ the function's name, the argument its guess goes by
    -- ('' for no guess; see above: the guess is the same statement without its created_at
    -- test, on the partition holding that argument), and what it is for. The fenced writes
    -- match only the caller's token on a key in progress; a lease only grows (greatest()
    -- ignores a NULL expires_at, which keeps the lease as it is).
    v_routes constant text[][] := ARRAY[
        ['_key_row', 'scope text, key text, created_at timestamptz', 'idempotency.keys', $sql$
        SELECT k.* INTO v_done
        FROM @table@ AS k
        WHERE k.scope = @fn@.scope AND k.key = @fn@.key
          AND k.created_at = @fn@.created_at;$sql$,
         '', 'claim()''s and takeover()''s read of the key''s row'],
        ['_complete_row',
         'scope text, key text, lease_token bigint, created_at timestamptz, status integer, '
         || 'headers jsonb, body jsonb, body_bytes bytea, content_type text, '
         || 'completed_at timestamptz',
         'timestamptz', $sql$
        UPDATE @table@ AS k
        SET state = 'completed',
            lease_expires_at = NULL,
            response_status = @fn@.status,
            response_headers = @fn@.headers,
            response_body = @fn@.body,
            response_body_bytes = @fn@.body_bytes,
            response_content_type = @fn@.content_type,
            completed_at = @fn@.completed_at
        WHERE k.scope = @fn@.scope AND k.key = @fn@.key
          AND k.lease_token = @fn@.lease_token AND k.state = 'in_progress'
          AND k.created_at = @fn@.created_at
        RETURNING k.completed_at INTO v_done;$sql$,
         'completed_at',
         'complete()''s and complete_bytes()'' fenced UPDATE'],
        ['_heartbeat_row',
         'scope text, key text, lease_token bigint, created_at timestamptz, '
         || 'expires_at timestamptz',
         'timestamptz', $sql$
        UPDATE @table@ AS k
        SET lease_expires_at = greatest(k.lease_expires_at, @fn@.expires_at)
        WHERE k.scope = @fn@.scope AND k.key = @fn@.key
          AND k.lease_token = @fn@.lease_token AND k.state = 'in_progress'
          AND k.created_at = @fn@.created_at
        RETURNING k.lease_expires_at INTO v_done;$sql$,
         '', 'heartbeat()''s fenced UPDATE'],
        ['_checkpoint_row',
         'scope text, key text, lease_token bigint, created_at timestamptz, '
         || 'recovery_point text, expires_at timestamptz',
         'timestamptz', $sql$
        UPDATE @table@ AS k
        SET recovery_point = @fn@.recovery_point,
            lease_expires_at = greatest(k.lease_expires_at, @fn@.expires_at)
        WHERE k.scope = @fn@.scope AND k.key = @fn@.key
          AND k.lease_token = @fn@.lease_token AND k.state = 'in_progress'
          AND k.created_at = @fn@.created_at
        RETURNING k.lease_expires_at INTO v_done;$sql$,
         '', 'checkpoint()''s fenced UPDATE'],
        ['_accept_row',
         'scope text, key text, lease_token bigint, created_at timestamptz, status integer, '
         || 'headers jsonb, body jsonb, expires_at timestamptz',
         'timestamptz', $sql$
        UPDATE @table@ AS k
        SET response_status = @fn@.status,
            response_headers = @fn@.headers,
            response_body = @fn@.body,
            response_body_bytes = NULL,
            response_content_type =
                CASE WHEN @fn@.body IS NULL THEN NULL ELSE 'application/json' END,
            lease_expires_at = greatest(k.lease_expires_at, @fn@.expires_at)
        WHERE k.scope = @fn@.scope AND k.key = @fn@.key
          AND k.lease_token = @fn@.lease_token AND k.state = 'in_progress'
          AND k.created_at = @fn@.created_at
        RETURNING k.lease_expires_at INTO v_done;$sql$,
         '', 'accept()''s fenced UPDATE'],
        ['_release_row',
         'scope text, key text, lease_token bigint, created_at timestamptz',
         'boolean', $sql$
        UPDATE @table@ AS k
        SET state = 'released',
            lease_expires_at = NULL,
            response_status = NULL,
            response_headers = NULL,
            response_body = NULL,
            response_body_bytes = NULL,
            response_content_type = NULL
        WHERE k.scope = @fn@.scope AND k.key = @fn@.key
          AND k.lease_token = @fn@.lease_token AND k.state = 'in_progress'
          AND k.created_at = @fn@.created_at
        RETURNING true INTO v_done;$sql$,
         '', 'release()''s fenced UPDATE'],
        ['_drop_released_row',
         'scope text, key text, created_at timestamptz, lease_token bigint',
         'boolean', $sql$
        DELETE FROM @table@ AS k
        WHERE k.scope = @fn@.scope AND k.key = @fn@.key
          AND k.created_at = @fn@.created_at
          AND k.state = 'released' AND k.lease_token = @fn@.lease_token
        RETURNING true INTO v_done;$sql$,
         '', 'claim()''s removal of a released row, compared on its token'],
        ['_resume_row',
         'scope text, key text, created_at timestamptz, lease_token bigint, '
         || 'new_token bigint, lease_expires_at timestamptz, reference_time timestamptz',
         'idempotency.claim_result', $sql$
        UPDATE @table@ AS k
        SET lease_token = @fn@.new_token,
            lease_expires_at = @fn@.lease_expires_at,
            attempts = k.attempts + 1
        WHERE k.scope = @fn@.scope AND k.key = @fn@.key
          AND k.created_at = @fn@.created_at
          AND k.lease_token = @fn@.lease_token AND k.state = 'in_progress'
          AND k.lease_expires_at <= @fn@.reference_time
        RETURNING 'resumed', k.lease_token, k.lease_expires_at, k.recovery_point, k.attempts,
                  NULL::integer, NULL::jsonb, NULL::jsonb, NULL::bytea, NULL::text,
                  NULL::interval, k.created_at, NULL::timestamptz
        INTO v_done;$sql$,
         '', 'the takeover of an expired lease (claim''s and takeover()''s compare-and-set)']
    ];
    v_names text[];
    v_lowers timestamptz[];
    v_uppers timestamptz[];
    v_fn text;
    v_stmt text;
    v_branches text;
    v_lookup text;
    v_guess text;
    v_source text;
    v_proc text;
    v_signature regprocedure;
    v_changed boolean := false;
    v_distributed boolean := idempotency._distributed();
    -- The width of a partition of keys (see below: the guess's window).
    v_interval interval;
    -- The guess's test of created_at where there are no partitions to branch on (see below),
    -- with @fn@ for the function's name.
    v_window text;
    -- A local half's parameters (its route's without created_at), declared and as passed.
    v_local_params text;
    v_local_args text;
    -- On Citus: the shards of keys, their tables, and the co-located shards of key_directory.
    v_shards bigint[];
    v_shard_tables text[];
    v_directory_shards bigint[];
    v_directory_tables text[];
    -- The functions to make: name, parameters, return type, source, plan_cache_mode ('' for
    -- none), comment, language and volatility.
    v_make text[][] := '{}'::text[];
    -- Every local half on Citus (see below): @type@ its result, @fn@ its name, @branches@ its
    -- statements on the shards, which put the result in v_done.
    v_local_source constant text := $src$
-- Generated by idempotency._make_routes(): do not edit.
DECLARE
    v_done @type@;
    v_shard bigint;
BEGIN
    v_shard := pg_catalog.get_shard_id_for_distribution_column(
        'idempotency.keys', @fn@.scope);
    -- The lock as an expression, not a PERFORM: no plan or executor to start per call.
    IF pg_catalog.lock_shard_metadata(5, ARRAY[v_shard]) IS NULL THEN
        RETURN NULL;
    END IF;
    IF current_setting('citus.enable_local_execution') <> 'on'
       OR current_setting('transaction_isolation') <> 'read committed'
       -- The shard's one placement, and it is here.
       OR (SELECT array_agg(p.groupid) FROM pg_catalog.pg_dist_placement AS p
           WHERE p.shardid = v_shard)
          IS DISTINCT FROM (SELECT ARRAY[g.groupid] FROM pg_catalog.pg_dist_local_group AS g)
    THEN
        RETURN NULL;
    END IF;@branches@
    RETURN v_done;
END;
$src$;
BEGIN
    -- The partitions, read once for every route. Newest first: most calls concern keys claimed
    -- moments ago, and complete's guess goes by its own time. The partitions made ahead come
    -- last, since no key is created in the future (a test clock aside): otherwise today's
    -- partition would come after every partition made ahead, in every call. A route made
    -- before midnight tests yesterday's partition first after it, until maintain() makes
    -- them again.
    -- None on Citus (idempotency.distribute): there each statement goes to the scope's shard of
    -- the parent, and the worker prunes its partitions; a branch per partition would only add
    -- a lock statement and tests to every call.
    SELECT coalesce(array_agg(format('idempotency.%I', p.partition_name)
                              ORDER BY p.lower_bound > now(), p.lower_bound DESC), '{}'),
           array_agg(p.lower_bound ORDER BY p.lower_bound > now(), p.lower_bound DESC),
           array_agg(p.upper_bound ORDER BY p.lower_bound > now(), p.lower_bound DESC)
    INTO v_names, v_lowers, v_uppers
    FROM idempotency._partitions('keys') AS p
    WHERE NOT p.is_default AND p.lower_bound IS NOT NULL AND p.upper_bound IS NOT NULL
      AND NOT v_distributed;
    -- On Citus, the shards of keys and their tables, for the local routes (Citus's catalog
    -- exists only where it is installed: dynamic SQL).
    IF v_distributed THEN
        EXECUTE 'SELECT array_agg(s.shardid ORDER BY s.shardid), '
                '       array_agg(pg_catalog.shard_name(s.logicalrelid, s.shardid) '
                '                 ORDER BY s.shardid), '
                '       array_agg(d.shardid ORDER BY s.shardid), '
                '       array_agg(pg_catalog.shard_name(d.logicalrelid, d.shardid) '
                '                 ORDER BY s.shardid) '
                'FROM pg_catalog.pg_dist_shard AS s '
                'JOIN pg_catalog.pg_dist_shard AS d '
                '  ON d.logicalrelid = $2 AND d.shardminvalue = s.shardminvalue '
                'WHERE s.logicalrelid = $1'
        INTO v_shards, v_shard_tables, v_directory_shards, v_directory_tables
        USING 'idempotency.keys'::regclass, 'idempotency.key_directory'::regclass;
    END IF;

    SELECT s.partition_interval INTO v_interval FROM idempotency.settings AS s;

    FOR i IN 1 .. array_length(v_routes, 1) LOOP
        v_fn := v_routes[i][1];
        v_stmt := replace(v_routes[i][4], '@fn@', v_fn);
        v_branches := idempotency._route_branches(v_fn, 'created_at', v_stmt, v_names, v_lowers,
                                                  v_uppers);
        IF v_branches <> '' THEN
            v_branches := v_branches
                || E'\n    END IF;\n    IF FOUND THEN\n        RETURN v_done;\n    END IF;';
        END IF;
        v_lookup := '';
        IF v_routes[i][5] <> '' THEN
            -- The guess, then the directory's created_at for the branches below. The second
            -- PERFORM only sets FOUND to false again (the directory read set it), so that the
            -- test after those branches means "a branch found the row".
            v_guess := replace(v_stmt, format(E'\n          AND k.created_at = %s.created_at',
                                              v_fn), '');
            IF v_guess = v_stmt THEN
                -- A guess that still compared created_at (NULL here) would never match: every
                -- call would pay for it and read the directory anyway, and nothing would say so.
                RAISE EXCEPTION USING
                    MESSAGE = format('idempotency._make_routes: the statement of %s has no '
                                     'created_at test line for its guess to leave out', v_fn),
                    ERRCODE = 'internal_error';
            END IF;
            v_lookup := idempotency._route_branches(v_fn, v_routes[i][5], v_guess, v_names,
                                                    v_lowers, v_uppers);
            IF v_lookup <> '' THEN
                v_lookup := v_lookup
                    || E'\n    END IF;\n    IF FOUND THEN\n        RETURN v_done;\n    END IF;';
            ELSE
                -- No partitions to branch on (on Citus the statement goes to the scope's
                -- shard, and the shard's partitions are pruned where it runs): the guess is
                -- the statement on the parent for a key created in the hour up to the
                -- argument and in the argument's own partition (its bin of
                -- settings.partition_interval from _partition_origin(), as _partition_start
                -- bins for maintain()), which the plan prunes to that one partition. date_bin
                -- and the origin's value, not a call of _partition_start: with constant
                -- arguments (custom plans) the planner would run that SQL function.
                -- Without the partition's bound the hour reached into the previous partition
                -- for the first hour of each one
                -- (the previous day's, or the default partition) and every guess scanned two.
                -- A key claimed in the previous partition and completed
                -- in this one misses the guess and is read through the directory below. On
                -- Citus a directory read is a statement through Citus's executor like any
                -- other, which the guess saves. The width as seconds: date_bin counts a day
                -- as 24 hours either way, and the literal reads back under any IntervalStyle.
                v_window := format(
                    E'\n          AND k.created_at > @fn@.%1$s - interval ''1 hour'''
                    || E'\n          AND k.created_at >= pg_catalog.date_bin('
                    || E'interval ''%2$s seconds'', @fn@.%1$s,'
                    || E'\n                                                   '
                    || E'timestamptz %3$L)'
                    || E'\n          AND k.created_at <= @fn@.%1$s',
                    v_routes[i][5],
                    trim_scale(extract(EPOCH FROM coalesce(v_interval, interval '1 day'))),
                    idempotency._partition_origin());
                v_lookup := replace(replace(v_stmt, format(
                        E'\n          AND k.created_at = %s.created_at', v_fn),
                        replace(v_window, '@fn@', v_fn)),
                    '@table@', 'idempotency.keys')
                    || E'\n    IF FOUND THEN\n        RETURN v_done;\n    END IF;';
                IF v_shards IS NOT NULL THEN
                    SELECT string_agg(trim(a), ', ' ORDER BY n),
                           string_agg(format('%s.%s', v_fn, split_part(trim(a), ' ', 1)), ', '
                                      ORDER BY n)
                    INTO v_local_params, v_local_args
                    FROM unnest(string_to_array(v_routes[i][2], ',')) WITH ORDINALITY AS t (a, n)
                    WHERE split_part(trim(a), ' ', 1) <> 'created_at';
                    -- On Citus the guess runs first in the route's local half, <route>_local,
                    -- on the scope's shard itself when this node holds it (see below); NULL
                    -- means not here or no row, and the guess through Citus follows.
                    v_lookup := format(
                        E'\n    v_done := idempotency.%1$I(%2$s);'
                        || E'\n    IF v_done IS NOT NULL THEN\n        RETURN v_done;'
                        || E'\n    END IF;', v_fn || '_local', v_local_args)
                        || v_lookup;
                    -- The local half. A delegated body's statements on the distributed
                    -- tables each go through Citus's planner and executor on the worker
                    -- (~100-150 us of CPU each) and must be planned afresh there
                    -- (_citus_custom_plans); a static statement on the shard's own table is
                    -- planned once per session and costs what it costs on one server. Safe
                    -- only while the shard stays here: first the lock Citus's own executor
                    -- takes before it writes to a shard (ShareLock on the shard's metadata),
                    -- which a shard move or split takes exclusively on every node before it
                    -- stops writes, then the placement read under it: the shard's only
                    -- placement must be this node's (a moved shard's old table stays until
                    -- Citus drops it, so the table's existence says nothing; a shard
                    -- replicated to other nodes is left to Citus, which writes every copy).
                    -- The read must see what committed while the lock waited: only under
                    -- READ COMMITTED does the statement after the lock take a new snapshot
                    -- (a REPEATABLE READ business transaction would still see a shard that
                    -- moved away since its first statement; Citus's own executor reads its
                    -- metadata cache instead). A shard a split made after this was generated
                    -- has no branch and runs nothing: the guess through Citus does the work
                    -- until maintain() generates the routes again. Not with Citus's local
                    -- execution off either: Citus would then reach this node's shards
                    -- through connections of their own, which would not see this write.
                    v_make := v_make || ARRAY[[
                        v_fn || '_local', v_local_params, v_routes[i][3],
                        replace(replace(replace(v_local_source,
                                                '@type@', v_routes[i][3]),
                                        '@fn@', v_fn || '_local'),
                            -- Last, so that nothing in the statements is replaced.
                            '@branches@', idempotency._shard_branches(v_shards, ARRAY(
                                SELECT replace(replace(replace(v_routes[i][4],
                                    E'\n          AND k.created_at = @fn@.created_at',
                                    v_window), '@fn@', v_fn || '_local'),
                                    '@table@', s.name)
                                FROM unnest(v_shard_tables) WITH ORDINALITY AS s (name, n)
                                ORDER BY s.n))),
                        -- Generic plans: these statements name no distributed table, and a
                        -- plan made once per session is the point (the caller's setting on
                        -- Citus is force_custom_plan).
                        'force_generic_plan',
                        format('Internal, generated by _make_routes() on Citus: %s on the '
                               'scope''s shard of keys when this node holds it, for a key '
                               'created in the hour up to %s and in its partition; NULL '
                               'otherwise.',
                               v_routes[i][6], v_routes[i][5]),
                        'plpgsql VOLATILE']];
                END IF;
            END IF;
            v_lookup := format(
                E'\n    IF %1$s.created_at IS NULL THEN%2$s'
                || E'\n    SELECT d.created_at INTO %1$s.created_at'
                || E'\n    FROM idempotency.key_directory AS d'
                || E'\n    WHERE d.scope = %1$s.scope'
                || E'\n      AND d.key_hash = sha256(convert_to(%1$s.key, ''UTF8''));'
                -- A key absent from the directory probes the partition of the guess's time,
                -- as an existing one probes its own: without a probe it answered ~12 us
                -- sooner, an oracle for a wrong token (docs/design.md; H6's measurement).
                || E'\n    %1$s.created_at := coalesce(%1$s.created_at, %1$s.%4$s);%3$s'
                || E'\n    END IF;',
                v_fn, v_lookup,
                CASE WHEN v_branches = '' THEN ''
                     ELSE E'\n    PERFORM FROM ONLY idempotency.keys AS parent WHERE false;' END,
                v_routes[i][5]);
        END IF;
        IF v_branches <> '' THEN
            -- The lock on the parent comes before the branches' to_regclass tests: a DROP or
            -- DETACH of a partition locks the parent exclusively, so no test can pass for a
            -- partition that is gone before its statement runs. LOCK TABLE ONLY takes the
            -- same lock as a query on the parent alone (ACCESS SHARE, to the end of the
            -- transaction) without planning and starting an executor, which the
            -- PERFORM ... WHERE false before 0.11.0 did. (The routes are VOLATILE, so a LOCK
            -- runs in them even under a STABLE caller.)
            v_lookup := E'\n    LOCK TABLE ONLY idempotency.keys IN ACCESS SHARE MODE;'
                        || v_lookup;
        END IF;
        v_source := format(
            E'\n-- Generated by idempotency._make_routes(): do not edit.\n'
            'DECLARE\n    v_done %s;\nBEGIN%s%s%s\n    RETURN v_done;\nEND;\n',
            v_routes[i][3], v_lookup, v_branches,
            replace(v_stmt, '@table@', 'idempotency.keys'));
        -- The route, after its local half (it calls that).
        v_make := v_make || ARRAY[[
            v_fn, v_routes[i][2], v_routes[i][3], v_source, '',
            format('Internal, generated by _make_routes(): %s on the partition of keys that '
                   'created_at names, through the parent when no branch finds the row.',
                   v_routes[i][6]),
            'plpgsql VOLATILE']];
    END LOOP;

    IF v_shards IS NOT NULL THEN
        -- claim()'s local half: a new key's directory row and keys row by static statements
        -- on the scope's shards, under the same lock and placement read as the routes' local
        -- halves above (the directory's shard is co-located with the keys' shard: a move or
        -- split takes them together). A NULL outcome when the key is taken (claim() goes on
        -- through Citus and its retry loop) or the shards are elsewhere.
        v_make := v_make || ARRAY[[
            '_claim_row_local',
            'scope text, key text, fingerprint bytea, lease interval, created_at timestamptz',
            'idempotency.claim_result',
            replace(replace(replace(v_local_source,
                                    '@type@', 'idempotency.claim_result'),
                            '@fn@', '_claim_row_local'),
                    '@branches@', idempotency._shard_branches(v_shards, ARRAY(
                SELECT replace(replace(replace($sql$
        INSERT INTO @directory@ AS d (scope, key_hash, created_at)
        VALUES (_claim_row_local.scope, sha256(convert_to(_claim_row_local.key, 'UTF8')),
                _claim_row_local.created_at)
        ON CONFLICT ON CONSTRAINT @constraint@ DO NOTHING;
        IF FOUND THEN
            INSERT INTO @table@ AS k (
                scope, key, fingerprint, state, lease_token, lease_expires_at, created_at
            )
            VALUES (_claim_row_local.scope, _claim_row_local.key,
                    _claim_row_local.fingerprint, 'in_progress', idempotency._new_token(NULL),
                    _claim_row_local.created_at + _claim_row_local.lease,
                    _claim_row_local.created_at)
            RETURNING 'claimed', k.lease_token, k.lease_expires_at, k.attempts, k.created_at
            INTO v_done.outcome, v_done.lease_token, v_done.lease_expires_at,
                 v_done.attempts, v_done.created_at;
        END IF;$sql$,
                    -- Citus names a shard's constraints after the table's, with the shard id.
                    '@constraint@', quote_ident('key_directory_pkey_' || s.directory_shard)),
                    '@directory@', s.directory), '@table@', s.name)
                FROM unnest(v_shard_tables, v_directory_tables, v_directory_shards)
                     WITH ORDINALITY AS s (name, directory, directory_shard, n)
                ORDER BY s.n))),
            'force_generic_plan',
            'Internal, generated by _make_routes() on Citus: claim()''s INSERTs of a new key '
            'on the scope''s shards when this node holds them; a NULL outcome otherwise.',
            'plpgsql VOLATILE'
        ], [
            '_local_shards', '', 'boolean', E'\nSELECT true\n', '',
            'Internal: true when _make_routes has generated the local halves of the routes '
            '(Citus); false on one server.',
            'sql IMMUTABLE'
        ]];
    END IF;

    FOR j IN 1 .. array_length(v_make, 1) LOOP
        -- 'idempotency.name(text, bigint, ...)': the parameters' types, for to_regprocedure.
        v_proc := format(
            'idempotency.%s(%s)', v_make[j][1],
            (SELECT string_agg(split_part(trim(a), ' ', 2), ', ' ORDER BY n)
             FROM unnest(string_to_array(nullif(v_make[j][2], ''), ','))
                  WITH ORDINALITY AS t (a, n)));
        v_signature := to_regprocedure(v_proc);
        IF v_signature IS NULL
           OR NOT EXISTS (
               SELECT FROM pg_proc AS p
               WHERE p.oid = v_signature AND p.prosrc = v_make[j][4]
                 AND p.proconfig IS NOT DISTINCT FROM
                     CASE WHEN v_make[j][5] <> ''
                          THEN ARRAY['plan_cache_mode=' || v_make[j][5]] END) THEN
            -- No SET clause on a route: only functions that pin search_path call it, and a
            -- SET would cost a GUC save and restore on every call. The local halves'
            -- plan_cache_mode is worth that (see above).
            EXECUTE format($ddl$
                CREATE OR REPLACE FUNCTION idempotency.%I(%s)
                RETURNS %s
                -- plpgsql VOLATILE for the routes: each statement takes its own snapshot,
                -- after the caller's locks.
                LANGUAGE %s
                %s
                AS %L$ddl$, v_make[j][1], v_make[j][2], v_make[j][3], v_make[j][7],
                CASE WHEN v_make[j][5] = '' THEN ''
                     ELSE format('SET plan_cache_mode = %s', v_make[j][5]) END,
                v_make[j][4]);
            v_signature := to_regprocedure(v_proc);
            -- CREATE OR REPLACE keeps the privileges of a function that existed; a new one
            -- would be executable by PUBLIC.
            EXECUTE format('REVOKE ALL ON FUNCTION %s FROM public', v_signature);
            EXECUTE format('COMMENT ON FUNCTION %s IS %L', v_signature, v_make[j][6]);
            v_changed := true;
        END IF;
    END LOOP;
    RETURN v_changed;
END;
$make$;

COMMENT ON FUNCTION idempotency._make_routes() IS
'Internal: (re)generate _key_row, _complete_row (with its guess), _heartbeat_row,
_checkpoint_row, _accept_row, _release_row, _resume_row and _drop_released_row, which address
one partition of keys by a static statement per partition; on Citus also _complete_row_local
and _claim_row_local (complete''s guess and claim''s INSERTs on the local shard) and
_local_shards() (true); true when any was replaced. Run by _create_partition, distribute()
and maintain().';
