-- Gauges for Prometheus (docs/operations.md: the postgres exporter's queries file), or any
-- scraper in any language, after pgmq's metrics() convention: one row, one column per gauge.
-- Nothing is counted on the claim/complete path; what is read here, and what it costs:
--   - the keys in progress, exactly: one pass over idempotency.keys reading state. No index
--     serves it, on purpose (an index on state or lease_expires_at would make every complete()
--     and heartbeat() a non-HOT update with a second index write; see sql/tables/keys.sql), so
--     its cost grows with the stored keys: about 1.5 s at 3 million keys (1 GB), measured in
--     docs/operations.md. This is the only part that reads rows, and scan => false leaves it
--     out (its columns are then NULL), so a scraper can read the cheap gauges on every scrape
--     and the pass less often;
--   - totals, completed keys, tombstones, rows in the default partition: the statistics
--     collector's live-tuple counts (pg_stat_all_tables.n_live_tup), estimates that lag a
--     little behind, read per partition without touching a row;
--   - partitions, bytes and the next drop: the catalog (pg_inherits, relation sizes);
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
    v_run idempotency.maintenance_runs;
BEGIN
    SELECT s.* INTO v_settings FROM idempotency.settings AS s;
    IF NOT FOUND THEN
        -- Before the first _premake() or maintain(): the defaults apply.
        v_settings := ROW(true, interval '1 day', interval '24 hours', 3, false,
                          interval '30 days', true, interval '200 milliseconds');
    END IF;

    IF metrics.scan IS NULL THEN
        PERFORM idempotency._invalid_argument('idempotency.metrics', 'scan', 'IK010',
                                              'must not be NULL');
    ELSIF metrics.scan THEN
        SELECT count(*),
               count(*) FILTER (WHERE k.lease_expires_at <= v_now),
               min(k.created_at),
               min(k.lease_expires_at) FILTER (WHERE k.lease_expires_at <= v_now)
        INTO v_out.keys_in_progress, v_out.keys_expired_leases, v_oldest, v_oldest_expired
        FROM idempotency.keys AS k
        WHERE k.state = 'in_progress';
        v_out.oldest_in_progress_age_seconds :=
            extract(EPOCH FROM v_now - v_oldest)::double precision;
        v_out.oldest_expired_lease_age_seconds :=
            extract(EPOCH FROM v_now - v_oldest_expired)::double precision;
    END IF;

    SELECT coalesce(sum(pg_stat_get_live_tuples(i.inhrelid)) FILTER (
               WHERE i.inhparent = 'idempotency.keys'::regclass), 0)::bigint,
           coalesce(sum(pg_stat_get_live_tuples(i.inhrelid)) FILTER (
               WHERE i.inhparent = 'idempotency.tombstones'::regclass), 0)::bigint,
           coalesce(sum(pg_total_relation_size(i.inhrelid)), 0)::bigint
    INTO v_out.keys_total_estimate, v_out.tombstones_estimate, v_out.total_bytes
    FROM pg_inherits AS i
    WHERE i.inhparent IN ('idempotency.keys'::regclass, 'idempotency.inbox'::regclass,
                          'idempotency.tombstones'::regclass,
                          'idempotency.key_directory'::regclass);
    IF metrics.scan THEN
        v_out.keys_completed_estimate :=
            greatest(v_out.keys_total_estimate - v_out.keys_in_progress, 0);
    END IF;
    v_out.keys_default_estimate := pg_stat_get_live_tuples('idempotency.keys_default'::regclass);

    SELECT count(*)::integer, (count(*) FILTER (WHERE p.lower_bound > v_now))::integer
    INTO v_out.partitions, v_out.partitions_ahead
    FROM idempotency._partitions('keys') AS p
    WHERE NOT p.is_default;
    v_out.premake := v_settings.premake;

    -- As partition_status(): a partition goes once it is wholly older than its window, never
    -- the newest one; keys and inbox only while maintain() manages their partitions.
    SELECT min(p.upper_bound + CASE t.parent WHEN 'tombstones'
                                   THEN v_settings.tombstone_retention
                                   ELSE v_settings.retention END)
    INTO v_next_drop
    FROM unnest(ARRAY['keys', 'inbox', 'tombstones']) AS t (parent)
    CROSS JOIN LATERAL idempotency._partitions(t.parent) AS p
    WHERE NOT p.is_default
      AND (t.parent = 'tombstones' OR v_settings.manage_partitions)
      AND p.upper_bound < (
          SELECT max(n.upper_bound) FROM idempotency._partitions(t.parent) AS n
          WHERE NOT n.is_default
      );
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
'Gauges for monitoring, one row: keys in progress, expired leases and the oldest of each (exact,
one pass over the keys in progress; NULL with scan => false), estimated totals, completed keys, tombstones and rows in
the default partition, partitions and partitions ahead, bytes, seconds to the next drop, and
the last maintain() run (age, duration, outcome, what it did). See docs/operations.md.';
