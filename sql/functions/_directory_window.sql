-- How long a key can be looked up: the longest a row of idempotency.keys can stay (retention,
-- plus the partition_interval by which a partition's newest row outlives its oldest) or, with
-- tombstones on, the longest a tombstone can (tombstone_retention plus the same). Rounded up
-- to whole days, so that the directory's partitions start at midnight UTC and their names
-- (idempotency._partition_name) stay unique whatever the settings were when each was made.
-- It is both the width of a partition of idempotency.key_directory and how long one is kept
-- after its upper bound: a lookup probes at most the previous, the current and the next
-- partition, and the default one.
CREATE FUNCTION idempotency._directory_window(settings idempotency.settings)
RETURNS interval
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT make_interval(days => ceil(extract(EPOCH FROM
        CASE WHEN (settings).tombstones THEN (settings).tombstone_retention
             ELSE (settings).retention END
        + (settings).partition_interval) / 86400)::integer);
$$;

COMMENT ON FUNCTION idempotency._directory_window(idempotency.settings) IS
'Internal: width of a partition of idempotency.key_directory, and how long it is kept after its
upper bound (the longest a key or its tombstone stays, in whole days).';
