-- idempotency.metrics()'s exact gauges per scope, for scopes with keys in progress or released
-- (a scope with neither has no row). The same one pass over idempotency.keys as metrics().
CREATE FUNCTION idempotency.metrics_by_scope(reference_time timestamptz DEFAULT NULL)
RETURNS SETOF idempotency.scope_metrics
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER  -- for monitoring roles without table privileges (grant_usage 'monitor')
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now timestamptz := CASE WHEN metrics_by_scope.reference_time IS NULL
        THEN clock_timestamp()
        ELSE idempotency._test_clock('idempotency.metrics_by_scope',
                                     metrics_by_scope.reference_time) END;
BEGIN
    PERFORM idempotency._require_coordinator('idempotency.metrics_by_scope');
    RETURN QUERY
    SELECT k.scope,
           count(*) FILTER (WHERE k.state = 'in_progress'),
           count(*) FILTER (WHERE k.state = 'in_progress' AND k.lease_expires_at <= v_now),
           extract(EPOCH FROM v_now - min(k.created_at) FILTER (
               WHERE k.state = 'in_progress'))::double precision,
           count(*) FILTER (WHERE k.state = 'released')
    FROM idempotency.keys AS k
    WHERE k.state IN ('in_progress', 'released')
    GROUP BY k.scope
    ORDER BY k.scope;
END;
$$;

COMMENT ON FUNCTION idempotency.metrics_by_scope(timestamptz) IS
'Per scope with keys in progress or released: keys in progress, expired leases, the oldest key
in progress''s age in seconds, released keys. Exact, one pass over those keys. See
docs/operations.md.';
