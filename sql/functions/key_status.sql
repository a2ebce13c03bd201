-- Observability, for operators (pg-idempotency status): keys by scope and state, the oldest key
-- in progress, expired leases nobody has taken over yet, live tombstones. It reads every row,
-- so run it on demand, not on every scrape of a busy system.
CREATE FUNCTION idempotency.key_status(reference_time timestamptz DEFAULT NULL)
RETURNS SETOF idempotency.key_status
-- PL/pgSQL, not SQL: Citus cannot plan a SQL function's parameterised query (its planner sees
-- the parameters unresolved).
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER  -- for maintainer roles without table privileges (grant_usage 'maintainer')
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now timestamptz := coalesce(key_status.reference_time, clock_timestamp());
BEGIN
    PERFORM idempotency._require_coordinator('idempotency.key_status');
    IF key_status.reference_time IS NOT NULL THEN
        PERFORM idempotency._check_time('idempotency.key_status', 'reference_time',
                                        key_status.reference_time);
    END IF;
    -- The ORDER BY names the columns of an outer query: over a UNION ALL of two distributed
    -- tables, Citus 14 returned positional ORDER BY 1, 2 unsorted.
    RETURN QUERY
    SELECT s.* FROM (
    SELECT k.scope,
           k.state,
           count(*),
           min(k.created_at),
           (array_agg(k.key ORDER BY k.created_at) FILTER (WHERE k.state = 'in_progress'))[1],
           count(*) FILTER (
               WHERE k.state = 'in_progress'
                 AND k.lease_expires_at <= v_now
           ),
           min(k.lease_expires_at) FILTER (
               WHERE k.state = 'in_progress'
                 AND k.lease_expires_at <= v_now
           )
    FROM idempotency.keys AS k
    GROUP BY k.scope, k.state
    UNION ALL
    SELECT t.scope, 'tombstone', count(*), min(t.created_at), NULL, NULL, NULL
    FROM idempotency.tombstones AS t
    WHERE t.expires_at > v_now
    GROUP BY t.scope
    ) AS s (scope, state, keys, oldest_created_at, oldest_key, expired_leases,
            oldest_expired_lease)
    ORDER BY s.scope, s.state;
END;
$$;

COMMENT ON FUNCTION idempotency.key_status(timestamptz) IS
'Keys per scope and state (in_progress, completed, released, tombstone): count, oldest, the
oldest key in progress, expired leases waiting for takeover. Reads every row.';
