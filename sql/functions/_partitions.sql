-- The partitions of idempotency.keys, inbox or tombstones with their bounds,
-- read back from the catalog rather than from their names: partitions made by pg_partman, or
-- under an earlier partition_interval, are seen exactly as the ones maintain() made. Bounds
-- PostgreSQL prints as MINVALUE/MAXVALUE are returned as NULL, and maintain() never touches such
-- a partition.
--
-- pg_get_expr prints the bounds as text in the session's DateStyle and TimeZone, and a zone
-- abbreviation does not always read back as itself: Europe/Dublin's summer "IST" reads as
-- Israel's +02, so under DateStyle 'SQL, DMY' every bound came back an hour early and maintain()
-- dropped keys before their retention ended. Both settings are pinned here, so the text is ISO
-- with a numeric UTC offset whatever the caller's session says.
CREATE FUNCTION idempotency._partitions(parent text)
RETURNS TABLE (
    partition_name text, lower_bound timestamptz, upper_bound timestamptz, is_default boolean
)
LANGUAGE sql
STABLE
SET search_path = pg_catalog, pg_temp
SET datestyle = 'ISO, YMD'
SET timezone = 'UTC'
AS $$
    SELECT c.relname::text,
           b.m[1]::timestamptz,
           b.m[2]::timestamptz,
           c.relpartbound IS NOT NULL AND pg_get_expr(c.relpartbound, c.oid) = 'DEFAULT'
    FROM pg_inherits AS i
    INNER JOIN pg_class AS c ON i.inhrelid = c.oid
    CROSS JOIN LATERAL (
        -- Printed and read back under the pinned DateStyle and TimeZone above.
        SELECT regexp_match(pg_get_expr(c.relpartbound, c.oid),
                            $re$^FOR VALUES FROM \('([^']+)'\) TO \('([^']+)'\)$re$) AS m
    ) AS b
    WHERE i.inhparent = to_regclass(format('idempotency.%I', parent))
    ORDER BY 2 NULLS FIRST, 1
$$;

COMMENT ON FUNCTION idempotency._partitions(text) IS
'Internal: partitions of idempotency.<parent> (keys, inbox or tombstones) with
their range bounds, oldest first; is_default marks the default partition.';
