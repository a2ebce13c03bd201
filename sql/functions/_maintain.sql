-- The work of idempotency.maintain() (below), which wraps it to record each run in
-- idempotency.maintenance_runs. Everything said here is what maintain() does.
--
-- Retention by partitions, for idempotency.keys, idempotency.inbox and idempotency.tombstones.
-- Run it from a scheduler (pg_cron: schedule_maintenance; cron; a Kubernetes CronJob) as often
-- as you like: every step is idempotent and a run that finds nothing to do changes nothing.
--
-- A run has two phases, because the first exclusive lock it takes on a parent table is held
-- until the run's transaction commits, and every claim waits for it meanwhile:
--
-- 1. Slow work under ordinary locks only, while claims go on: tombstones for the keys about to
--    go (settings.tombstones), deleting expired rows from the default partitions, counting the
--    rows of the partitions to drop.
-- 2. Fast DDL, each step under settings.maintenance_lock_timeout (200 ms by default): drop the
--    partitions wholly older than the retention (never the newest one), move rows that wait in
--    a default partition into a partition made for them, create settings.premake partitions
--    ahead. A step whose lock is not granted in time is skipped and reported, and so are the
--    later steps on that table: the run never queues an exclusive lock in front of live claims
--    for longer than the timeout, and a long transaction can only make it skip.
--
-- Tables are taken in the order keys, tombstones, inbox: claim() locks keys before tombstones,
-- so a run never holds the tombstones lock while it waits for the keys lock.
--
-- Whatever drops, deletes or expires is measured from v_until: reference_time, or now() when
-- reference_time is later. A key is promised at least the retention, and a reference_time
-- ahead of the clock (now() + 2 days, 9998-12-31) once dropped keys 18 hours old. Partitions
-- are still made ahead of reference_time: making one early loses nothing.
CREATE FUNCTION idempotency._maintain(reference_time timestamptz DEFAULT now())
RETURNS SETOF idempotency.maintenance_action
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_settings idempotency.settings;
    v_saved_lock_timeout text := current_setting('lock_timeout');
    v_parents text[] := ARRAY['keys', 'tombstones', 'inbox'];
    v_parent text;
    v_window interval;
    v_newest timestamptz;
    v_keep_from timestamptz;
    v_cutoff timestamptz;
    v_column text;
    v_part record;
    v_count bigint;
    v_drops idempotency.maintenance_action[] := ARRAY[]::idempotency.maintenance_action[];
    v_blocked text[] := ARRAY[]::text[];
    v_step idempotency.maintenance_action;
    v_timeout text;
    v_forgotten bigint := 0::bigint;
    v_until timestamptz;
BEGIN
    IF _maintain.reference_time IS NULL THEN
        PERFORM idempotency._invalid_argument('idempotency.maintain', 'reference_time', 'IK010',
                                              'must not be NULL');
    END IF;
    -- 'infinity' dropped every partition holding keys, 294276-12-31 raised 22008 from the
    -- partition arithmetic, 1960-01-01 made partitions for 1960: the range every reference_time
    -- has (see _check_time).
    PERFORM idempotency._check_time('idempotency.maintain', 'reference_time',
                                    _maintain.reference_time);
    v_until := least(_maintain.reference_time, now());
    -- Two runs at once would only wait for each other's locks: the second one leaves at once.
    -- Lock space 3 (1 and 2 were the key locks of keys and inbox before 0.9.0).
    IF NOT pg_try_advisory_xact_lock(3, 0) THEN
        v_step.action := 'skipped';
        v_step.reason := 'another idempotency.maintain() run holds the maintenance lock';
        RETURN NEXT v_step;
        RETURN;
    END IF;
    INSERT INTO idempotency.settings DEFAULT VALUES ON CONFLICT (id) DO NOTHING;
    SELECT s.* INTO STRICT v_settings FROM idempotency.settings AS s;
    IF idempotency._distributed() THEN
        -- Citus: the partition DDL below may not follow statements that ran on many shards in
        -- parallel in the same transaction; one connection per node keeps both possible.
        PERFORM set_config('citus.multi_shard_modify_mode', 'sequential', true);
    END IF;

    -- Phase 1: no exclusive lock yet.
    FOREACH v_parent IN ARRAY v_parents LOOP
        IF v_parent <> 'tombstones' AND NOT v_settings.manage_partitions THEN
            v_step := ROW('skipped', v_parent, NULL::text, NULL::timestamptz, NULL::timestamptz,
                          NULL::bigint,
                          'settings.manage_partitions is off: its partitions are managed '
                          || 'elsewhere (pg_partman)');
            RETURN NEXT v_step;
            CONTINUE;
        END IF;
        v_window := CASE v_parent WHEN 'tombstones' THEN v_settings.tombstone_retention
                                  ELSE v_settings.retention END;
        v_column := CASE v_parent WHEN 'inbox' THEN 'received_at' ELSE 'created_at' END;

        -- The rows of the newest interval that holds any are never dropped or deleted, however
        -- far ahead reference_time is, so that no argument empties the table (a reference_time
        -- in 9998 dropped every key, and every retry after it executed again). v_keep_from is
        -- the start of that interval (_keep_from, which partition_status() and metrics() use
        -- too).
        -- The cost: a system that took no new row for longer than the window keeps its last
        -- interval's rows until newer ones come (docs/maintenance.md).
        v_keep_from := NULL;
        IF v_window IS NOT NULL THEN
            v_keep_from := idempotency._keep_from(v_parent, v_settings.partition_interval);
        END IF;
        -- Rows (and partitions wholly) before v_cutoff go.
        v_cutoff := least(v_until - v_window, v_keep_from);

        -- Rows of the default partition past their retention: no partition to drop, so delete.
        IF v_parent = 'keys' AND v_settings.tombstones THEN
            v_count := idempotency._write_tombstones(
                'keys_default', v_cutoff,
                v_settings.tombstone_retention, v_until);
            IF v_count > 0 THEN
                v_step := ROW('tombstoned', v_parent, 'keys_default', NULL::timestamptz,
                              NULL::timestamptz, v_count,
                              'keys past the retention in the default partition');
                RETURN NEXT v_step;
            END IF;
        END IF;
        -- Their directory rows first (keys that got a tombstone just above keep theirs).
        v_forgotten := v_forgotten + idempotency._drop_directory_rows(
            v_parent, v_parent || '_default',
            CASE WHEN v_parent = 'tombstones' AND NOT v_settings.tombstones
                 THEN 'infinity' ELSE v_cutoff END);
        IF v_parent = 'tombstones' AND NOT v_settings.tombstones THEN
            -- Tombstones off: an expired key is a new request, so forget them all.
            v_window := NULL;
            DELETE FROM idempotency.tombstones_default;
        ELSE
            EXECUTE format('DELETE FROM idempotency.%I WHERE %I < $1', v_parent || '_default',
                           v_column)
            USING v_cutoff;
        END IF;
        GET DIAGNOSTICS v_count = ROW_COUNT;
        IF v_count > 0 THEN
            v_step := ROW('deleted', v_parent, v_parent || '_default', NULL::timestamptz,
                          NULL::timestamptz, v_count,
                          CASE WHEN v_window IS NULL THEN 'settings.tombstones is off'
                               ELSE format('older than %s (%s)', v_window,
                                           CASE v_parent WHEN 'tombstones'
                                               THEN 'tombstone_retention'
                                               ELSE 'retention' END) END);
            RETURN NEXT v_step;
        END IF;

        -- Ranged partitions wholly older than the window, oldest first.
        SELECT max(p.upper_bound) INTO v_newest
        FROM idempotency._partitions(v_parent) AS p WHERE NOT p.is_default;
        FOR v_part IN
            SELECT p.partition_name, p.lower_bound, p.upper_bound
            FROM idempotency._partitions(v_parent) AS p
            WHERE NOT p.is_default
              AND (v_window IS NULL OR p.upper_bound <= v_until - v_window)
            ORDER BY p.lower_bound
        LOOP
            IF v_window IS NOT NULL AND v_part.upper_bound = v_newest THEN
                -- A reference_time far ahead must not empty the table of partitions.
                v_step := ROW('skipped', v_parent, v_part.partition_name, v_part.lower_bound,
                              v_part.upper_bound, NULL::bigint,
                              'the newest partition is never dropped');
                RETURN NEXT v_step;
                CONTINUE;
            END IF;
            IF v_window IS NOT NULL AND v_part.upper_bound > v_cutoff THEN
                -- Nor the one holding the newest rows, nor any after it (see v_keep_from).
                v_step := ROW('skipped', v_parent, v_part.partition_name, v_part.lower_bound,
                              v_part.upper_bound, NULL::bigint,
                              'never dropped: it holds the newest rows, or comes after them');
                RETURN NEXT v_step;
                CONTINUE;
            END IF;
            IF v_parent = 'keys' AND v_settings.tombstones THEN
                v_count := idempotency._write_tombstones(
                    v_part.partition_name, v_part.upper_bound,
                    v_settings.tombstone_retention, v_until);
                v_step := ROW('tombstoned', v_parent, v_part.partition_name, v_part.lower_bound,
                              v_part.upper_bound, v_count, 'before the partition is dropped');
                RETURN NEXT v_step;
            END IF;
            -- Now, under ordinary locks, not next to the DROP below: phase 2 must stay short.
            -- Should the DROP be skipped, these keys are past their retention and a retry of
            -- one is a new request, as it would be once the partition is gone.
            v_forgotten := v_forgotten + idempotency._drop_directory_rows(
                v_parent, v_part.partition_name, 'infinity');
            EXECUTE format('SELECT count(*) FROM idempotency.%I', v_part.partition_name)
            INTO v_count;
            v_drops := v_drops || ROW(
                'dropped', v_parent, v_part.partition_name, v_part.lower_bound,
                v_part.upper_bound, v_count,
                CASE WHEN v_window IS NULL THEN 'settings.tombstones is off'
                     ELSE format('wholly older than %s (%s)', v_window,
                                 CASE v_parent WHEN 'tombstones' THEN 'tombstone_retention'
                                               ELSE 'retention' END) END
            )::idempotency.maintenance_action;
        END LOOP;
    END LOOP;

    -- Phase 2: DDL under a short lock_timeout (local to this transaction; restored below).
    v_timeout := ceil(extract(EPOCH FROM v_settings.maintenance_lock_timeout) * 1000)::bigint
                 || ' ms';
    PERFORM set_config('lock_timeout', v_timeout, true);
    FOREACH v_parent IN ARRAY v_parents LOOP
        CONTINUE WHEN v_parent <> 'tombstones' AND NOT v_settings.manage_partitions;
        FOREACH v_step IN ARRAY v_drops LOOP
            CONTINUE WHEN v_step.parent_table <> v_parent;
            IF v_parent = ANY (v_blocked) THEN
                v_step.action := 'skipped';
                v_step.reason := format('not dropped: an earlier step could not lock '
                                        'idempotency.%s', v_parent);
                RETURN NEXT v_step;
                CONTINUE;
            END IF;
            BEGIN
                -- Also takes ACCESS EXCLUSIVE on the parent, held until the run commits.
                EXECUTE format('DROP TABLE idempotency.%I', v_step.partition_name);
                RETURN NEXT v_step;
            EXCEPTION WHEN lock_not_available THEN
                v_blocked := v_blocked || v_parent;
                v_step.action := 'skipped';
                v_step.reason := format(
                    'not dropped: idempotency.%s was not locked within %s '
                    '(settings.maintenance_lock_timeout); a transaction is using it',
                    v_parent, v_timeout);
                RETURN NEXT v_step;
            END;
        END LOOP;
        FOR v_step IN
            SELECT * FROM idempotency._make_partitions(
                v_parent, v_settings, _maintain.reference_time, v_parent = ANY (v_blocked))
        LOOP
            IF v_step.action = 'skipped' AND v_step.reason LIKE '%was not locked within%' THEN
                v_blocked := v_blocked || v_parent;
            END IF;
            RETURN NEXT v_step;
        END LOOP;
    END LOOP;

    IF v_forgotten > 0 THEN
        v_step := ROW('deleted', 'key_directory', 'key_directory', NULL::timestamptz,
                      NULL::timestamptz, v_forgotten,
                      'the directory rows of the keys and tombstones that go');
        RETURN NEXT v_step;
    END IF;
    IF NOT v_settings.manage_partitions THEN
        -- pg_partman drops partitions of keys and inbox without telling: forget the directory
        -- rows that point at no key, tombstone or message any more (a claim would treat such a row as a new
        -- key anyway; this only keeps the directory from growing). It reads the whole
        -- directory, so only in this mode.
        DELETE FROM idempotency.key_directory AS d
        WHERE d.created_at < v_until - v_settings.retention
          AND NOT EXISTS (
              SELECT FROM idempotency.keys AS k
              WHERE k.scope = d.scope AND k.created_at = d.created_at
                AND idempotency._key_hash(k.key) = d.key_hash
          )
          AND NOT EXISTS (
              SELECT FROM idempotency.tombstones AS t
              WHERE t.scope = d.scope AND t.key_hash = d.key_hash
                AND t.created_at = d.created_at
          )
          AND NOT EXISTS (
              SELECT FROM idempotency.inbox AS i
              WHERE i.consumer = d.scope AND i.received_at = d.created_at
                AND idempotency._key_hash(chr(31) || i.message_id) = d.key_hash
          );
        GET DIAGNOSTICS v_count = ROW_COUNT;
        IF v_count > 0 THEN
            v_step := ROW('deleted', 'key_directory', 'key_directory', NULL::timestamptz,
                          NULL::timestamptz, v_count,
                          format('older than %s (retention) and pointing to no key or '
                                 'tombstone (partitions dropped elsewhere)',
                                 v_settings.retention));
            RETURN NEXT v_step;
        END IF;
    END IF;
    -- The partitions of keys may have changed (here, or by pg_partman since the last run).
    PERFORM idempotency._make_routes();
    PERFORM set_config('lock_timeout', v_saved_lock_timeout, true);
    RETURN;
END;
$$;

COMMENT ON FUNCTION idempotency._maintain(timestamptz) IS
'Internal: the steps of idempotency.maintain(), which records each run in
idempotency.maintenance_runs. See docs/maintenance.md.';
