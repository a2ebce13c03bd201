-- Observability, for operators (pg-idempotency status): every partition of keys, inbox and
-- tombstones with its rows, its size, and when maintain() will drop it.
-- Counts rows exactly, partition by partition, so it reads every row too.
CREATE FUNCTION idempotency.partition_status(reference_time timestamptz DEFAULT NULL)
RETURNS SETOF idempotency.partition_status
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER  -- for maintainer roles without table privileges (grant_usage 'maintainer')
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now timestamptz := coalesce(partition_status.reference_time, clock_timestamp());
    v_settings idempotency.settings;
    v_parent text;
    v_newest timestamptz;
    v_keep_from timestamptz;
    v_window interval;
    v_part record;
    v_row idempotency.partition_status;
BEGIN
    PERFORM idempotency._require_coordinator('idempotency.partition_status');
    IF partition_status.reference_time IS NOT NULL THEN
        PERFORM idempotency._check_time('idempotency.partition_status', 'reference_time',
                                        partition_status.reference_time);
    END IF;
    SELECT s.* INTO v_settings FROM idempotency.settings AS s;
    IF NOT FOUND THEN
        -- Before the first _premake() or maintain(): the defaults apply.
        v_settings := ROW(true, interval '1 day', interval '24 hours', 3, false,
                          interval '30 days', true, interval '200 milliseconds', 1048576,
                          1048576, 16384);
    END IF;
    FOREACH v_parent IN ARRAY ARRAY['keys', 'inbox', 'tombstones'] LOOP
        v_window := CASE v_parent WHEN 'tombstones' THEN v_settings.tombstone_retention
                                  ELSE v_settings.retention END;
        SELECT max(p.upper_bound) INTO v_newest
        FROM idempotency._partitions(v_parent) AS p WHERE NOT p.is_default;
        v_keep_from := NULL;
        IF v_parent = 'tombstones' OR v_settings.manage_partitions THEN
            v_keep_from := idempotency._keep_from(v_parent, v_settings.partition_interval);
        END IF;
        FOR v_part IN
            SELECT p.* FROM idempotency._partitions(v_parent) AS p
        LOOP
            v_row := ROW(v_parent, v_part.partition_name, v_part.lower_bound,
                         v_part.upper_bound, NULL::bigint, NULL::bigint, NULL::timestamptz,
                         NULL::text);
            EXECUTE format('SELECT count(*) FROM idempotency.%I', v_part.partition_name)
            INTO v_row.row_count;
            v_row.total_bytes :=
                pg_total_relation_size(format('idempotency.%I', v_part.partition_name));
            IF v_part.is_default THEN
                v_row.note := 'default';
            ELSIF v_parent IN ('keys', 'inbox') AND NOT v_settings.manage_partitions THEN
                v_row.note := 'managed elsewhere';
            ELSIF v_part.upper_bound = v_newest THEN
                v_row.note := 'newest';
            ELSIF v_part.upper_bound + v_window <= v_now
                  AND v_part.upper_bound > coalesce(v_keep_from, 'infinity') THEN
                -- Past its window, but maintain() keeps it: it holds the newest rows, or comes
                -- after the partition that does (_keep_from). It goes once newer rows exist.
                v_row.note := 'kept';
            ELSE
                v_row.drop_after := v_part.upper_bound + v_window;
                v_row.note := CASE
                    WHEN v_row.drop_after <= v_now THEN 'due'
                    WHEN v_part.lower_bound > v_now THEN 'ahead'
                    WHEN v_part.upper_bound > v_now THEN 'current'
                    ELSE 'retained' END;
            END IF;
            RETURN NEXT v_row;
        END LOOP;
    END LOOP;
END;
$$;

COMMENT ON FUNCTION idempotency.partition_status(timestamptz) IS
'Every partition of keys, inbox and tombstones: bounds, exact row count, total
size, drop_after (when maintain() will drop it; NULL for the default and the newest
partition, and for one it keeps past its retention because it holds the newest rows or comes
after the one that does) and a note (default, newest, kept, ahead, current, retained, due,
managed elsewhere).';
