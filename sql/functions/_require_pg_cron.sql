-- pg_cron is optional: the scheduling functions exist everywhere and reach cron.* through
-- dynamic SQL only, so they can be created without it; this raises the documented error when
-- it is missing.
CREATE FUNCTION idempotency._require_pg_cron(fn text)
RETURNS void
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_extension AS e WHERE e.extname = 'pg_cron') THEN
        RAISE EXCEPTION USING
            MESSAGE = format('%s: pg_cron is not installed in this database', _require_pg_cron.fn),
            ERRCODE = 'IK020',
            DETAIL = format('No pg_cron extension in database %s.', current_database()),
            HINT = 'Install pg_cron (shared_preload_libraries = ''pg_cron'', cron.database_name '
                   || 'set to this database, CREATE EXTENSION pg_cron), or run '
                   || 'idempotency.maintain() from cron or a Kubernetes CronJob '
                   || '(docs/maintenance.md).';
    END IF;
END;
$$;

COMMENT ON FUNCTION idempotency._require_pg_cron(text) IS
'Internal: raise IK020 unless pg_cron is installed in this database.';
