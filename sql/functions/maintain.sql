-- Retention by partitions, for idempotency.keys, idempotency.inbox and idempotency.tombstones:
-- the steps are idempotency._maintain()'s (read there how a run goes). This wrapper returns
-- them as they come and records the run in idempotency.maintenance_runs at its end, in the
-- run's own transaction, so idempotency.metrics() can tell when maintenance last ran, how long
-- it took and what it did without anything being written on the claim/complete path.
-- The run's row records the time its drops were measured from: reference_time, or now() when
-- reference_time is later (a future reference_time never drops a key younger than the
-- retention; see _maintain).
--
-- SECURITY DEFINER so that a scheduler need not be the owner: grant_usage(kind =>
-- 'maintainer') lets a role run it, and run nothing else that writes. Such a role runs it at
-- the clock only: a past reference_time writes tombstones that expire early and records a
-- false time in maintenance_runs, so any reference_time but now() (the default) is the owner's
-- test clock (_test_clock, IK017).
CREATE FUNCTION idempotency.maintain(reference_time timestamptz DEFAULT now())
RETURNS SETOF idempotency.maintenance_action
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_started timestamptz := clock_timestamp();
    v_step idempotency.maintenance_action;
    v_created integer := 0;
    v_dropped integer := 0;
    v_rows bigint := 0::bigint;
    v_skipped integer := 0;
    v_not_done boolean := false;
    v_whole_run_skipped boolean := false;
    v_id bigint;
BEGIN
    PERFORM idempotency._require_coordinator('idempotency.maintain');
    IF maintain.reference_time <> now() THEN
        PERFORM idempotency._test_clock('idempotency.maintain', maintain.reference_time);
    END IF;
    FOR v_step IN SELECT * FROM idempotency._maintain(maintain.reference_time) LOOP
        CASE v_step.action
            WHEN 'created' THEN
                v_created := v_created + 1;
            WHEN 'dropped' THEN
                v_dropped := v_dropped + 1;
            WHEN 'skipped' THEN
                v_skipped := v_skipped + 1;
                -- "not dropped: ...", "not moved: ...", "not created: ...": a step that was
                -- due but could not be done (a lock not granted in time, an error caught).
                -- Other skips are by design (the newest partition, manage_partitions off).
                v_not_done := v_not_done OR v_step.reason LIKE 'not %';
                v_whole_run_skipped := v_whole_run_skipped OR v_step.parent_table IS NULL;
            ELSE
                v_rows := v_rows + coalesce(v_step.row_count, 0);
        END CASE;
        RETURN NEXT v_step;
    END LOOP;
    INSERT INTO idempotency.maintenance_runs (
        started_at, finished_at, reference_time, outcome, created, dropped, rows_changed,
        skipped_steps
    )
    VALUES (
        v_started, clock_timestamp(), least(maintain.reference_time, now()),
        CASE WHEN v_whole_run_skipped THEN 'skipped'
             WHEN v_not_done THEN 'partial'
             ELSE 'ok' END,
        v_created, v_dropped, v_rows, v_skipped
    )
    RETURNING id INTO v_id;
    DELETE FROM idempotency.maintenance_runs WHERE id <= v_id - 1000;
    RETURN;
END;
$$;

COMMENT ON FUNCTION idempotency.maintain(timestamptz) IS
'Retention by partitions for keys, inbox and tombstones, with the key_directory rows of what
goes: write tombstones (opt-in), drop partitions wholly older than the retention (never the newest), move rows out of the default
partitions, create settings.premake partitions ahead. Skips and reports any step whose lock is
not granted within settings.maintenance_lock_timeout, and a run while another one is active.
Returns what it did and records the run in idempotency.maintenance_runs. Security definer: a
maintainer role (grant_usage) runs it, at the clock only (reference_time other than now():
IK017 unless the caller is the schema owner). See docs/maintenance.md.';
