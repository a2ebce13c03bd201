-- The start of the newest interval of parent (keys, inbox or tombstones) that holds any row:
-- the newest ranged partition with a row, or the partition_interval bucket of the default
-- partition's newest row when that is newer; NULL when the table is empty. maintain() never
-- drops or deletes a row from there on, however far ahead its reference_time (a reference_time
-- in 9998 once dropped every key, and every retry after it executed again), and
-- partition_status() and metrics() use the same rule, so that what they call due is what the
-- next maintain() drops. Partitions are read newest first and only until a row is found: the
-- ones made ahead are empty, so this usually reads two or three of them.
CREATE FUNCTION idempotency._keep_from(parent text, partition_interval interval)
RETURNS timestamptz
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_part record;
    v_found boolean;
    v_keep_from timestamptz;
    v_default_newest timestamptz;
BEGIN
    FOR v_part IN
        SELECT p.partition_name, p.lower_bound FROM idempotency._partitions(_keep_from.parent) AS p
        WHERE NOT p.is_default AND p.lower_bound IS NOT NULL
        ORDER BY p.lower_bound DESC
    LOOP
        -- (SELECT 1: Citus plans "SELECT FROM" a distributed table as a record.)
        EXECUTE format('SELECT EXISTS (SELECT 1 FROM idempotency.%I)', v_part.partition_name)
        INTO v_found;
        IF v_found THEN
            v_keep_from := v_part.lower_bound;
            EXIT;
        END IF;
    END LOOP;
    EXECUTE format('SELECT idempotency._partition_start($1, max(d.%I)) FROM idempotency.%I AS d',
                   CASE _keep_from.parent WHEN 'inbox' THEN 'received_at' ELSE 'created_at' END,
                   _keep_from.parent || '_default')
    INTO v_default_newest
    USING _keep_from.partition_interval;
    RETURN greatest(v_keep_from, v_default_newest);
END;
$$;

COMMENT ON FUNCTION idempotency._keep_from(text, interval) IS
'Internal: the start of the newest partition_interval of parent (keys, inbox, tombstones) that
holds a row (NULL: none); maintain() keeps every row from there on.';
