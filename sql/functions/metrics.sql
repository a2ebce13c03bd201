-- Gauges for Prometheus (docs/operations.md: the postgres exporter's queries file), or any
-- scraper in any language, after pgmq's metrics() convention: one row, one column per gauge.
-- Nothing is counted on the claim/complete path; what is read here, and what it costs:
--   - the keys in progress and the released ones, exactly: one pass over idempotency.keys
--     reading state. No index
--     serves it, on purpose (an index on state or lease_expires_at would make every complete()
--     and heartbeat() a non-HOT update with a second index write; see sql/tables/keys.sql), so
--     its cost grows with the stored keys: about 1.5 s at 3 million keys (1 GB), measured in
--     docs/operations.md. This is the only part that reads rows, and scan => false leaves it
--     out (its columns are then NULL), so a scraper can read the cheap gauges on every scrape
--     and the pass less often;
--   - totals, completed keys, tombstones, rows in the default partition: the statistics
--     collector's live-tuple counts (pg_stat_all_tables.n_live_tup), estimates that lag a
--     little behind, read per partition without touching a row;
--   - partitions, bytes and the next drop: the catalog (pg_inherits, relation sizes); while a
--     partition is past its retention (until the next maintain() drops it, or for good on a
--     system that took no newer rows), also whether the newest partitions hold a row
--     (_keep_from: maintain() keeps those);
--   - on Citus (after distribute()), the same statistics and sizes, summed on each node over
--     the shards it holds.
--   - the last maintain() run: the newest row of idempotency.maintenance_runs.
-- The reference time is clock_timestamp(); only the schema's owner may move it (tests).
CREATE FUNCTION idempotency.metrics(
    reference_time timestamptz DEFAULT NULL,
    scan boolean DEFAULT true
)
RETURNS idempotency.metrics_result
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER  -- for monitoring roles without table privileges (grant_usage 'monitor')
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now timestamptz := CASE WHEN metrics.reference_time IS NULL THEN clock_timestamp()
        ELSE idempotency._test_clock('idempotency.metrics', metrics.reference_time) END;
    v_out idempotency.metrics_result;
    v_settings idempotency.settings;
    v_oldest timestamptz;
    v_oldest_expired timestamptz;
    v_next_drop timestamptz;
    v_parent text;
    v_window interval;
    v_part record;
    v_keep_from timestamptz;
    v_keep_read boolean;
    -- A record, not idempotency.maintenance_runs: that table is the coordinator's alone, and a
    -- row type naming it would fail to compile on a worker before IK022 could be raised.
    v_run record;
    v_count bigint;
BEGIN
    PERFORM idempotency._require_coordinator('idempotency.metrics');
    SELECT s.* INTO v_settings FROM idempotency.settings AS s;
    IF NOT FOUND THEN
        -- Before the first _premake() or maintain(): the defaults apply.
        v_settings := ROW(true, interval '1 day', interval '24 hours', 3, false,
                          interval '30 days', true, interval '200 milliseconds', 1048576,
                          1048576, 16384);
    END IF;

    IF metrics.scan IS NULL THEN
        PERFORM idempotency._invalid_argument('idempotency.metrics', 'scan', 'IK010',
                                              'must not be NULL');
    ELSIF metrics.scan THEN
        -- Released keys are read in the same pass (they are few: a key's next claim replaces
        -- its released row), so that the completed estimate below leaves them out.
        SELECT count(*) FILTER (WHERE k.state = 'in_progress'),
               count(*) FILTER (WHERE k.state = 'in_progress' AND k.lease_expires_at <= v_now),
               count(*) FILTER (WHERE k.state = 'released'),
               min(k.created_at) FILTER (WHERE k.state = 'in_progress'),
               min(k.lease_expires_at) FILTER (
                   WHERE k.state = 'in_progress' AND k.lease_expires_at <= v_now)
        INTO v_out.keys_in_progress, v_out.keys_expired_leases, v_out.keys_released, v_oldest,
             v_oldest_expired
        FROM idempotency.keys AS k
        WHERE k.state IN ('in_progress', 'released');
        v_out.oldest_in_progress_age_seconds :=
            extract(EPOCH FROM v_now - v_oldest)::double precision;
        v_out.oldest_expired_lease_age_seconds :=
            extract(EPOCH FROM v_now - v_oldest_expired)::double precision;
    END IF;

    IF idempotency._distributed() THEN
        -- Citus: the rows are in the shards on the workers, and the coordinator's own
        -- partitions are empty shells, so their statistics say 0. Each node sums the statistics
        -- and sizes of the shards it holds, found through its copy of pg_dist_shard (the shard
        -- of a partition is a table of its own), in one query per node, all nodes at once
        -- (run_command_on_all_nodes); still no row is read. A query per shard
        -- (run_command_on_shards) was an order of magnitude slower, and grew with the shards.
        -- Dynamic SQL: these functions and catalogs exist only where Citus is installed.
        EXECUTE $q$
            SELECT coalesce(sum(split_part(r.result, ',', 1)::bigint) FILTER (
                       WHERE r.success), 0)::bigint,
                   coalesce(sum(split_part(r.result, ',', 2)::bigint) FILTER (
                       WHERE r.success), 0)::bigint,
                   coalesce(sum(split_part(r.result, ',', 3)::bigint) FILTER (
                       WHERE r.success), 0)::bigint,
                   coalesce(sum(split_part(r.result, ',', 4)::bigint) FILTER (
                       WHERE r.success), 0)::bigint,
                   count(*) FILTER (WHERE NOT r.success)
            FROM pg_catalog.run_command_on_all_nodes($c$
                SELECT concat_ws(',',
                    coalesce(sum(pg_catalog.pg_stat_get_live_tuples(s.shard)) FILTER (
                        WHERE s.parent = 'idempotency.keys'::regclass), 0),
                    coalesce(sum(pg_catalog.pg_stat_get_live_tuples(s.shard)) FILTER (
                        WHERE s.parent = 'idempotency.tombstones'::regclass), 0),
                    coalesce(sum(pg_catalog.pg_stat_get_live_tuples(s.shard)) FILTER (
                        WHERE s.rel = 'idempotency.keys_default'::regclass), 0),
                    coalesce(sum(pg_catalog.pg_total_relation_size(s.shard)), 0))
                FROM (
                    SELECT d.logicalrelid AS rel,
                           coalesce(i.inhparent, d.logicalrelid) AS parent,
                           pg_catalog.to_regclass(
                               pg_catalog.shard_name(d.logicalrelid, d.shardid)) AS shard
                    FROM pg_catalog.pg_dist_shard AS d
                    LEFT JOIN pg_catalog.pg_inherits AS i ON i.inhrelid = d.logicalrelid
                ) AS s
                WHERE s.shard IS NOT NULL
                  AND s.parent IN ('idempotency.keys'::regclass, 'idempotency.inbox'::regclass,
                                   'idempotency.tombstones'::regclass,
                                   'idempotency.key_directory'::regclass)
            $c$) AS r
        $q$
        INTO v_out.keys_total_estimate, v_out.tombstones_estimate, v_out.keys_default_estimate,
             v_out.total_bytes, v_count;
        IF v_count > 0 THEN
            -- A node that did not answer: its part is missing, so say nothing rather than a
            -- number too small.
            v_out.keys_total_estimate := NULL;
            v_out.tombstones_estimate := NULL;
            v_out.keys_default_estimate := NULL;
            v_out.total_bytes := NULL;
        END IF;
    ELSE
        SELECT coalesce(sum(pg_stat_get_live_tuples(i.inhrelid)) FILTER (
                   WHERE i.inhparent = 'idempotency.keys'::regclass), 0)::bigint,
               coalesce(sum(pg_stat_get_live_tuples(i.inhrelid)) FILTER (
                   WHERE i.inhparent = 'idempotency.tombstones'::regclass), 0)::bigint,
               coalesce(sum(pg_total_relation_size(i.inhrelid)), 0)::bigint
        INTO v_out.keys_total_estimate, v_out.tombstones_estimate, v_out.total_bytes
        FROM pg_inherits AS i
        WHERE i.inhparent IN ('idempotency.keys'::regclass, 'idempotency.inbox'::regclass,
                              'idempotency.tombstones'::regclass);
        -- key_directory is not partitioned in 0.9.0.
        v_out.total_bytes := v_out.total_bytes
                             + pg_total_relation_size('idempotency.key_directory'::regclass);
        v_out.keys_default_estimate :=
            pg_stat_get_live_tuples('idempotency.keys_default'::regclass);
    END IF;
    IF metrics.scan AND v_out.keys_total_estimate IS NOT NULL THEN
        v_out.keys_completed_estimate := greatest(
            v_out.keys_total_estimate - v_out.keys_in_progress - v_out.keys_released, 0);
    END IF;

    SELECT count(*)::integer, (count(*) FILTER (WHERE p.lower_bound > v_now))::integer
    INTO v_out.partitions, v_out.partitions_ahead
    FROM idempotency._partitions('keys') AS p
    WHERE NOT p.is_default;
    v_out.premake := v_settings.premake;

    -- As partition_status(): a partition goes once it is wholly older than its window, never
    -- the newest one, nor one that holds the newest rows or comes after it (_keep_from); keys
    -- and inbox only while maintain() manages their partitions. _keep_from reads rows (an
    -- EXISTS per partition from the newest down, max() of the default partition), so it is
    -- asked only when a partition is past its window: after each maintain() run, none is.
    FOREACH v_parent IN ARRAY ARRAY['keys', 'inbox', 'tombstones'] LOOP
        CONTINUE WHEN v_parent <> 'tombstones' AND NOT v_settings.manage_partitions;
        v_window := CASE v_parent WHEN 'tombstones' THEN v_settings.tombstone_retention
                                  ELSE v_settings.retention END;
        v_keep_read := false;
        v_keep_from := NULL;
        FOR v_part IN
            SELECT p.upper_bound FROM idempotency._partitions(v_parent) AS p
            WHERE NOT p.is_default
              AND p.upper_bound < (
                  SELECT max(n.upper_bound) FROM idempotency._partitions(v_parent) AS n
                  WHERE NOT n.is_default
              )
            ORDER BY p.upper_bound
        LOOP
            IF v_part.upper_bound + v_window <= v_now THEN
                IF NOT v_keep_read THEN
                    v_keep_from := idempotency._keep_from(v_parent,
                                                          v_settings.partition_interval);
                    v_keep_read := true;
                END IF;
                -- Past its window but kept: not due until newer rows come.
                CONTINUE WHEN v_part.upper_bound > coalesce(v_keep_from, 'infinity');
            END IF;
            -- The earliest of this table (the partitions come oldest first).
            v_next_drop := least(v_next_drop, v_part.upper_bound + v_window);
            EXIT;
        END LOOP;
    END LOOP;
    v_out.next_drop_seconds := extract(EPOCH FROM v_next_drop - v_now)::double precision;

    SELECT r.* INTO v_run FROM idempotency.maintenance_runs AS r ORDER BY r.id DESC LIMIT 1;
    IF FOUND THEN
        v_out.maintain_last_run_age_seconds :=
            extract(EPOCH FROM v_now - v_run.finished_at)::double precision;
        v_out.maintain_last_duration_seconds :=
            extract(EPOCH FROM v_run.finished_at - v_run.started_at)::double precision;
        v_out.maintain_last_outcome := v_run.outcome;
        v_out.maintain_last_created := v_run.created;
        v_out.maintain_last_dropped := v_run.dropped;
        v_out.maintain_last_rows_changed := v_run.rows_changed;
        v_out.maintain_last_skipped_steps := v_run.skipped_steps;
    END IF;
    RETURN v_out;
END;
$$;

COMMENT ON FUNCTION idempotency.metrics(timestamptz, boolean) IS
'Gauges for monitoring, one row: keys in progress, expired leases and the oldest of each,
released keys (exact, one pass over the keys in progress or released; NULL with scan => false), estimated totals, completed keys, tombstones and rows in
the default partition, partitions and partitions ahead, bytes, seconds to the next drop, and
the last maintain() run (age, duration, outcome, what it did). See docs/operations.md.';
