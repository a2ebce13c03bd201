-- Keep partitions of idempotency.key_directory ready: the one holding reference_time and the
-- next one, each _directory_window() wide, contiguous with the newest one that exists (so a
-- change of the settings never makes two overlap). After a long pause (the newest one ends
-- before the current window) it starts afresh at the current window: rows dated in the gap
-- stay in the default partition, which every lookup probes too, so nothing is lost; rows in
-- the default partition for a range it makes are moved into it.
-- oldest (migration 0005): also cover the keys and tombstones that exist already.
-- Each creation waits at most the lock_timeout the caller set (maintain: the maintenance lock
-- timeout); one that is not granted ends the run with a skipped step, to be made next time.
CREATE FUNCTION idempotency._make_directory_partitions(
    settings idempotency.settings, reference_time timestamptz, oldest timestamptz DEFAULT NULL
)
RETURNS SETOF idempotency.maintenance_action
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_width interval := idempotency._directory_window(_make_directory_partitions.settings);
    v_origin CONSTANT timestamptz := timestamptz '2000-01-01 00:00:00+00';
    v_current timestamptz := date_bin(v_width, _make_directory_partitions.reference_time,
                                      v_origin);
    v_lower timestamptz;
    v_moved idempotency.key_directory[];
    v_step idempotency.maintenance_action;
BEGIN
    SELECT max(p.upper_bound) INTO v_lower
    FROM idempotency._partitions('key_directory') AS p WHERE NOT p.is_default;
    IF v_lower IS NULL THEN
        v_lower := date_bin(v_width, least(_make_directory_partitions.oldest, v_current),
                            v_origin);
    ELSIF v_lower < v_current THEN
        v_lower := v_current;
    END IF;
    WHILE v_lower <= _make_directory_partitions.reference_time + v_width LOOP
        v_step := ROW('created', 'key_directory',
                      idempotency._partition_name('key_directory', v_lower, v_width),
                      v_lower, v_lower + v_width, NULL::bigint, 'ahead of time');
        BEGIN
            -- Rows for the range already in the default partition (claims before the first
            -- run after CREATE EXTENSION, or after a long pause) move into the new partition,
            -- under the table's exclusive lock so that no claim misses them meanwhile.
            LOCK TABLE idempotency.key_directory IN ACCESS EXCLUSIVE MODE;
            WITH moved AS (
                DELETE FROM idempotency.key_directory_default AS d
                WHERE d.created_at >= v_lower AND d.created_at < v_lower + v_width
                RETURNING d.*
            )
            SELECT array_agg(ROW(m.scope, m.key_hash, m.created_at)::idempotency.key_directory),
                   count(*)
            INTO v_moved, v_step.row_count
            FROM moved AS m;
            IF NOT idempotency._create_partition('key_directory', v_lower,
                                                 v_lower + v_width) THEN
                RAISE EXCEPTION USING ERRCODE = 'duplicate_table', MESSAGE = format(
                    'idempotency.%s exists and is not a partition of idempotency.key_directory',
                    v_step.partition_name);
            END IF;
            INSERT INTO idempotency.key_directory
            SELECT m.* FROM unnest(v_moved) AS m;
            IF v_step.row_count > 0 THEN
                v_step.reason := format('with %s rows moved out of key_directory_default',
                                        v_step.row_count);
            ELSE
                v_step.row_count := NULL;
            END IF;
        EXCEPTION
            WHEN duplicate_table THEN
                v_step.action := 'skipped';
                v_step.reason := 'not created: ' || SQLERRM;
                RETURN NEXT v_step;
                RETURN;
            WHEN lock_not_available THEN
                v_step.action := 'skipped';
                v_step.reason := 'not created: idempotency.key_directory was not locked within '
                                 || current_setting('lock_timeout')
                                 || ' (settings.maintenance_lock_timeout); a transaction is '
                                 || 'using it';
                RETURN NEXT v_step;
                RETURN;
        END;
        RETURN NEXT v_step;
        v_lower := v_lower + v_width;
    END LOOP;
END;
$$;

COMMENT ON FUNCTION idempotency._make_directory_partitions(
    idempotency.settings, timestamptz, timestamptz
) IS
'Internal: create the partitions of idempotency.key_directory for reference_time and the next
window (and, given oldest, from there on).';
