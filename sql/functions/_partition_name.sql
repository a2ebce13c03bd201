-- Partition names sort in time order and say what they hold: keys_p20261202 for a daily
-- partition, keys_p20261202_1300 when the interval is not a whole number of days.
CREATE FUNCTION idempotency._partition_name(
    parent text, lower_bound timestamptz, partition_interval interval
)
RETURNS text
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT parent || '_p' || to_char(
        lower_bound AT TIME ZONE 'UTC',
        CASE WHEN extract(EPOCH FROM partition_interval)::bigint % 86400 = 0
            THEN 'YYYYMMDD' ELSE 'YYYYMMDD_HH24MI' END);
$$;

COMMENT ON FUNCTION idempotency._partition_name(text, timestamptz, interval) IS
'Internal: name of the partition of parent that starts at lower_bound.';
