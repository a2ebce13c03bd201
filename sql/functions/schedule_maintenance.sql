-- Registers idempotency.maintain() as the pg_cron job 'pg_idempotency_maintain' (replacing the
-- schedule when the job exists: cron.schedule with a job name updates it), run as the calling
-- role in this database. pg_cron must be installed here, which means this database is
-- cron.database_name.
CREATE FUNCTION idempotency.schedule_maintenance(schedule text)
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_jobid bigint;
BEGIN
    -- A job on a worker would run maintain() there, which only the coordinator serves.
    PERFORM idempotency._require_coordinator(
        'idempotency.schedule_maintenance',
        'maintain() runs on the coordinator, so its pg_cron job is scheduled there.');
    IF schedule_maintenance.schedule IS NULL THEN
        PERFORM idempotency._invalid_argument('idempotency.schedule_maintenance', 'schedule',
                                              'IK010', 'must not be NULL',
                                              'Pass a cron schedule such as ''*/10 * * * *''.');
    ELSIF btrim(schedule_maintenance.schedule) = '' THEN
        PERFORM idempotency._invalid_argument('idempotency.schedule_maintenance', 'schedule',
                                              'IK011', 'must not be empty',
                                              'Pass a cron schedule such as ''*/10 * * * *''.');
    END IF;
    PERFORM idempotency._require_pg_cron('idempotency.schedule_maintenance');
    -- Dynamic: cron.schedule does not exist where pg_cron is not installed. pg_cron checks the
    -- schedule itself and raises its own error for a bad one.
    EXECUTE 'SELECT cron.schedule($1, $2, $3)'
    INTO v_jobid
    USING 'pg_idempotency_maintain', schedule_maintenance.schedule,
          'SELECT * FROM idempotency.maintain()';
    RETURN v_jobid;
END;
$$;

COMMENT ON FUNCTION idempotency.schedule_maintenance(text) IS
'Schedule idempotency.maintain() with pg_cron as job pg_idempotency_maintain (replacing its
schedule if it exists); returns the job id. IK020 when pg_cron is not installed, IK022 on a
Citus worker.';
