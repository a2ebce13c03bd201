-- Removes the pg_cron job made by schedule_maintenance() for the calling role; false when there
-- was none (so it is safe in teardown scripts).
CREATE FUNCTION idempotency.unschedule_maintenance()
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_jobs bigint;
BEGIN
    -- The job is the coordinator's (schedule_maintenance); a worker has none to remove.
    PERFORM idempotency._require_coordinator(
        'idempotency.unschedule_maintenance',
        'maintain() runs on the coordinator, so its pg_cron job is scheduled there.');
    PERFORM idempotency._require_pg_cron('idempotency.unschedule_maintenance');
    -- Dynamic, as in schedule_maintenance. cron.unschedule raises for a missing job; look first.
    EXECUTE 'SELECT count(*) FROM cron.job WHERE jobname = $1 AND username = current_user'
    INTO v_jobs
    USING 'pg_idempotency_maintain';
    IF v_jobs = 0 THEN
        RETURN false;
    END IF;
    EXECUTE 'SELECT cron.unschedule($1)' USING 'pg_idempotency_maintain';
    RETURN true;
END;
$$;

COMMENT ON FUNCTION idempotency.unschedule_maintenance() IS
'Remove the pg_cron job pg_idempotency_maintain of the calling role; false when there was none.
IK020 when pg_cron is not installed, IK022 on a Citus worker.';
