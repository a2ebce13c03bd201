-- One row of idempotency.partition_status(): one partition and when maintain() will drop it.
CREATE TYPE idempotency.partition_status AS (
    -- keys | inbox | tombstones
    parent_table text,
    partition_name text,
    -- NULL for the default partition.
    lower_bound timestamptz,
    upper_bound timestamptz,
    row_count bigint,
    -- pg_total_relation_size: table, indexes and TOAST.
    total_bytes bigint,
    -- When the first maintain() at or after this time drops it; NULL: never (the default
    -- partition, the newest one, one kept past its window, or partitions maintain() does not
    -- manage).
    drop_after timestamptz,
    -- default | newest | kept (past its window, but it holds the newest rows or comes after
    -- the partition that does) | ahead | current | due (the next maintain() drops it) |
    -- retained | managed elsewhere
    note text
);

COMMENT ON TYPE idempotency.partition_status IS
'One partition of keys, inbox or tombstones, as reported by idempotency.partition_status().';
