-- The row of idempotency.metrics(): gauges for a scraper (docs/operations.md). Ages and
-- durations are in seconds; NULL where there is nothing to measure (no key in progress, no
-- maintain() run recorded yet).
CREATE TYPE idempotency.metrics_result AS (
    -- Exact, from one pass over the keys in progress or released (see metrics()).
    keys_in_progress bigint,
    -- In progress with the lease expired: waiting for a retry or a completer's takeover.
    keys_expired_leases bigint,
    -- Released (release() or force_release()): kept until the key's next claim replaces the
    -- row or its partition is dropped. Exact, from the same pass.
    keys_released bigint,
    oldest_in_progress_age_seconds double precision,
    oldest_expired_lease_age_seconds double precision,
    -- Estimates from the statistics collector (pg_stat_all_tables.n_live_tup), no row read.
    keys_total_estimate bigint,
    keys_completed_estimate bigint,
    tombstones_estimate bigint,
    -- Rows waiting in the default partitions of keys (premade partitions missing).
    keys_default_estimate bigint,
    -- Ranged partitions of keys, and how many of them start after the reference time.
    partitions integer,
    partitions_ahead integer,
    -- settings.premake: partitions_ahead below it means maintain() is behind.
    premake integer,
    -- pg_total_relation_size of every partition of keys, inbox, tombstones, key_directory.
    total_bytes bigint,
    -- Until the next partition of keys, inbox or tombstones is due to be dropped (negative:
    -- overdue, the next maintain() drops it; NULL: none retained).
    next_drop_seconds double precision,
    -- The last recorded maintain() run (idempotency.maintenance_runs).
    maintain_last_run_age_seconds double precision,
    maintain_last_duration_seconds double precision,
    -- ok | partial | skipped
    maintain_last_outcome text,
    maintain_last_created integer,
    maintain_last_dropped integer,
    maintain_last_rows_changed bigint,
    maintain_last_skipped_steps integer
);

COMMENT ON TYPE idempotency.metrics_result IS
'The gauges idempotency.metrics() returns; see docs/operations.md.';
