-- One row of the report idempotency.maintain() returns: one step it took or skipped.
CREATE TYPE idempotency.maintenance_action AS (
    -- created | moved | deleted | tombstoned | dropped | skipped
    action text,
    -- keys | inbox | tombstones | key_directory; NULL when the whole run was skipped.
    parent_table text,
    -- The partition concerned (without schema), when there is one.
    partition_name text,
    lower_bound timestamptz,
    upper_bound timestamptz,
    -- Rows moved, deleted, tombstoned or dropped with the partition.
    row_count bigint,
    -- Why: the retention that expired, the lock that was not granted, ...
    reason text
);

COMMENT ON TYPE idempotency.maintenance_action IS
'One step of an idempotency.maintain() run: created, moved, deleted, tombstoned, dropped or
skipped, with the reason.';
