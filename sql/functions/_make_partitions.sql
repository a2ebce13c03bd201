-- maintain(), phase 2, after the drops: give the rows waiting in parent's default partition a
-- partition of their own, then make the current partition and settings.premake ahead.
-- Called with lock_timeout already short. The first lock not granted in time ends the work on
-- this table for the run (the remaining steps are reported as skipped), and so does "blocked"
-- (an earlier drop timed out).
--
-- Moving rows out of the default partition happens under ACCESS EXCLUSIVE on the parent, taken
-- before the first row is read: every function that writes a key holds a lock on the parent
-- that conflicts with it, and takes its statement snapshot after its locks are granted, so no
-- claim, complete or takeover can act on a row while it is between two partitions. A writer
-- that started before waits for it (or makes this step skip); one that starts after sees the
-- row in its new partition. docs/design.md has the argument.
CREATE FUNCTION idempotency._make_partitions(
    parent text, settings idempotency.settings, reference_time timestamptz, blocked boolean
)
RETURNS SETOF idempotency.maintenance_action
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_interval interval := (_make_partitions.settings).partition_interval;
    v_current timestamptz :=
        idempotency._partition_start(v_interval, _make_partitions.reference_time);
    v_last timestamptz :=
        v_current + ((_make_partitions.settings).premake + 1) * v_interval;
    v_column text := CASE _make_partitions.parent WHEN 'inbox' THEN 'received_at'
                                                  ELSE 'created_at' END;
    v_default text := _make_partitions.parent || '_default';
    v_blocked boolean := _make_partitions.blocked;
    v_bucket timestamptz;
    v_overlap text;
    v_count bigint;
    v_step idempotency.maintenance_action;
    v_timeout text := ceil(extract(EPOCH FROM
        (_make_partitions.settings).maintenance_lock_timeout) * 1000)::bigint || ' ms';
BEGIN
    -- 1. Rows in the default partition, one partition_interval bucket at a time. (Expired rows
    --    were deleted in phase 1, so what is left is live.)
    FOR v_bucket IN
        EXECUTE format('SELECT DISTINCT idempotency._partition_start($1, d.%I) '
                       'FROM idempotency.%I AS d ORDER BY 1', v_column, v_default)
        USING v_interval
    LOOP
        v_step := ROW('skipped', _make_partitions.parent, v_default, v_bucket,
                      v_bucket + v_interval, NULL::bigint, NULL::text);
        SELECT p.partition_name INTO v_overlap
        FROM idempotency._partitions(_make_partitions.parent) AS p
        WHERE NOT p.is_default
          AND p.lower_bound < v_bucket + v_interval AND p.upper_bound > v_bucket
        LIMIT 1;
        IF v_bucket >= v_last THEN
            -- Dated after the partitions kept ready (a reference_time far ahead): claims ignore
            -- them until then, and a partition made now would be the newest for years.
            v_step.reason := 'rows dated after the partitions made ahead stay in the default '
                             || 'partition';
        ELSIF v_overlap IS NOT NULL THEN
            v_step.reason := format('the range overlaps partition %s (was partition_interval '
                                    'changed?); the rows stay in the default partition',
                                    v_overlap);
        ELSIF v_blocked THEN
            v_step.reason := format('not moved: an earlier step could not lock idempotency.%s',
                                    _make_partitions.parent);
        ELSE
            BEGIN
                EXECUTE format('LOCK TABLE ONLY idempotency.%I IN ACCESS EXCLUSIVE MODE',
                               _make_partitions.parent);
                EXECUTE format('CREATE TEMPORARY TABLE idempotency_moving '
                               '(LIKE idempotency.%I) ON COMMIT DROP', _make_partitions.parent);
                EXECUTE format('WITH d AS (DELETE FROM idempotency.%I WHERE %I >= $1 AND %I < $2 '
                               'RETURNING *) INSERT INTO pg_temp.idempotency_moving '
                               'SELECT * FROM d', v_default, v_column, v_column)
                USING v_bucket, v_bucket + v_interval;
                GET DIAGNOSTICS v_count = ROW_COUNT;
                IF NOT idempotency._create_partition(_make_partitions.parent, v_bucket,
                                                     v_bucket + v_interval) THEN
                    -- Only a table of that name that is not a partition gets here; the
                    -- handler below undoes the delete.
                    RAISE EXCEPTION USING ERRCODE = 'duplicate_table', MESSAGE = format(
                        'idempotency.%s exists and is not a partition of idempotency.%s',
                        idempotency._partition_name(_make_partitions.parent, v_bucket,
                                                    v_interval), _make_partitions.parent);
                END IF;
                EXECUTE format('INSERT INTO idempotency.%I SELECT * FROM '
                               'pg_temp.idempotency_moving', _make_partitions.parent);
                DROP TABLE pg_temp.idempotency_moving;
                v_step.action := 'moved';
                v_step.partition_name := idempotency._partition_name(
                    _make_partitions.parent, v_bucket, v_interval);
                v_step.row_count := v_count;
                v_step.reason := format('out of %s into a partition made for them', v_default);
            EXCEPTION
                WHEN lock_not_available THEN
                    v_blocked := true;
                    v_step.reason := format(
                        'not moved: idempotency.%s was not locked within %s '
                        '(settings.maintenance_lock_timeout); a transaction is using it',
                        _make_partitions.parent, v_timeout);
                WHEN duplicate_table THEN
                    v_step.reason := 'not moved: ' || SQLERRM;
            END;
        END IF;
        RETURN NEXT v_step;
    END LOOP;

    -- 2. The current partition and settings.premake ahead. Tombstones need partitions only
    --    while they are on: a tombstone's created_at is that of its key, so the partitions made
    --    ahead now are the ones the tombstones of these days will land in.
    IF _make_partitions.parent = 'tombstones' AND NOT (_make_partitions.settings).tombstones THEN
        RETURN;
    END IF;
    v_bucket := v_current;
    WHILE v_bucket < v_last LOOP
        -- An existing name costs no lock; _create_partition looks first.
        IF to_regclass(format('idempotency.%I', idempotency._partition_name(
                _make_partitions.parent, v_bucket, v_interval))) IS NULL THEN
            v_step := ROW('created', _make_partitions.parent,
                          idempotency._partition_name(_make_partitions.parent, v_bucket,
                                                      v_interval),
                          v_bucket, v_bucket + v_interval, NULL::bigint, 'ahead of time');
            IF v_blocked THEN
                v_step.action := 'skipped';
                v_step.reason := format('not created: an earlier step could not lock '
                                        'idempotency.%s', _make_partitions.parent);
                RETURN NEXT v_step;
            ELSE
                BEGIN
                    -- false: an overlapping partition covers the range (say, pg_partman's).
                    IF idempotency._create_partition(_make_partitions.parent, v_bucket,
                                                     v_bucket + v_interval) THEN
                        RETURN NEXT v_step;
                    END IF;
                EXCEPTION WHEN lock_not_available THEN
                    v_blocked := true;
                    v_step.action := 'skipped';
                    v_step.reason := format(
                        'not created: idempotency.%s was not locked within %s '
                        '(settings.maintenance_lock_timeout); a transaction is using it',
                        _make_partitions.parent, v_timeout);
                    RETURN NEXT v_step;
                END;
            END IF;
        END IF;
        v_bucket := v_bucket + v_interval;
    END LOOP;
END;
$$;

COMMENT ON FUNCTION idempotency._make_partitions(
    text, idempotency.settings, timestamptz, boolean
) IS
'Internal (maintain, phase 2): move rows out of the default partition of parent into partitions
made for them, then create the current partition and settings.premake ahead.';
