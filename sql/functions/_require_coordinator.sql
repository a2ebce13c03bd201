-- Refuses a call on a Citus worker with IK022, as distribute() does, for the functions that only
-- the coordinator can serve: maintenance and its pg_cron schedule (the partition DDL and
-- idempotency.maintenance_runs are the coordinator's), the metrics (maintenance_runs again,
-- and the statistics of every node, gathered from the coordinator), the status reports and
-- grant_usage() (idempotency.grants is the coordinator's, and Citus propagates GRANTs from
-- there only). On a worker they failed with raw 42P01 / 42704 / XX000, or scheduled a job
-- that could never run. Never on the per-key path: the per-key functions, operator ones
-- included (inspect_key, force_release), work on a worker of a metadata-synced cluster, so
-- none of them calls it. why, when given, replaces the DETAIL's reason. One catalog lookup
-- when Citus is installed, none otherwise.
CREATE FUNCTION idempotency._require_coordinator(fn text, why text DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_group integer;
BEGIN
    IF to_regclass('pg_catalog.pg_dist_local_group') IS NULL THEN
        RETURN;
    END IF;
    -- Dynamic SQL: Citus's catalog exists only where it is installed. Group 0 is the
    -- coordinator's (and that of a server Citus is installed on but that is in no cluster).
    EXECUTE 'SELECT g.groupid FROM pg_catalog.pg_dist_local_group AS g' INTO v_group;
    IF coalesce(v_group, 0) <> 0 THEN
        RAISE EXCEPTION USING
            MESSAGE = format('%s: this node is not the Citus coordinator',
                             _require_coordinator.fn),
            ERRCODE = 'IK022',
            DETAIL = format('This is a worker (Citus group %s). %s', v_group, coalesce(
                _require_coordinator.why,
                'Maintenance, metrics and the status reports run on the coordinator, which '
                'holds idempotency.maintenance_runs and reaches every node.')),
            HINT = 'Run it on the coordinator (docs/scale-out.md).';
    END IF;
END;
$$;

COMMENT ON FUNCTION idempotency._require_coordinator(text, text) IS
'Internal: raise IK022 when called on a Citus worker (a node whose Citus group is not 0).';
