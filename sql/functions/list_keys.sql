-- For operators (pg-idempotency keys list): stored keys by scope, state, age and lease, oldest
-- first, never with their bodies or lease tokens. The schema owner's alone, as inspect_key().
-- It reads every partition of idempotency.keys (no index serves state or age; see
-- sql/tables/keys.sql), so it is for an investigation, not for a scraper (that is metrics()).
CREATE FUNCTION idempotency.list_keys(
    scope text DEFAULT NULL,
    state text DEFAULT NULL,
    older_than interval DEFAULT NULL,
    expired_leases boolean DEFAULT false,
    max_keys integer DEFAULT 100
)
RETURNS SETOF idempotency.key_info
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
BEGIN
    IF list_keys.scope IS NOT NULL THEN
        PERFORM idempotency._check_name('idempotency.list_keys', 'scope', list_keys.scope);
    END IF;
    IF list_keys.state IS NOT NULL
       AND list_keys.state NOT IN ('in_progress', 'completed', 'released') THEN
        PERFORM idempotency._invalid_argument(
            'idempotency.list_keys', 'state', 'IK014',
            'must be ''in_progress'', ''completed'' or ''released''',
            format('It is %s.', to_json(list_keys.state)));
    END IF;
    -- Bounded above too: now - older_than must stay a time (300000 years raised 22008 from
    -- inside), and no key is older than 1000 years. An infinite interval (PostgreSQL 17 on) is
    -- above it.
    IF list_keys.older_than NOT BETWEEN interval '0' AND interval '1000 years' THEN
        PERFORM idempotency._invalid_argument('idempotency.list_keys', 'older_than', 'IK014',
                                              'must be between 0 and 1000 years',
                                              format('It is %s.', list_keys.older_than));
    END IF;
    IF list_keys.expired_leases IS NULL THEN
        PERFORM idempotency._invalid_argument('idempotency.list_keys', 'expired_leases',
                                              'IK010', 'must not be NULL');
    ELSIF list_keys.max_keys IS NULL THEN
        PERFORM idempotency._invalid_argument('idempotency.list_keys', 'max_keys', 'IK010',
                                              'must not be NULL');
    ELSIF list_keys.max_keys NOT BETWEEN 1 AND 10000 THEN
        PERFORM idempotency._invalid_argument('idempotency.list_keys', 'max_keys', 'IK014',
                                              'must be between 1 and 10000',
                                              format('It is %s.', list_keys.max_keys));
    END IF;
    RETURN QUERY
    SELECT k.scope, k.key, k.state, k.lease_expires_at,
           k.state = 'in_progress' AND k.lease_expires_at <= v_now,
           k.recovery_point, k.attempts, k.response_status, k.response_content_type,
           k.response_headers,
           coalesce(octet_length(k.response_body::text), octet_length(k.response_body_bytes)),
           NULL::jsonb, NULL::bytea, k.created_at, k.completed_at, k.tableoid::regclass::text
    FROM idempotency.keys AS k
    WHERE (list_keys.scope IS NULL OR k.scope = list_keys.scope)
      AND (list_keys.state IS NULL OR k.state = list_keys.state)
      AND (list_keys.older_than IS NULL OR k.created_at <= v_now - list_keys.older_than)
      AND (NOT list_keys.expired_leases
           OR (k.state = 'in_progress' AND k.lease_expires_at <= v_now))
    ORDER BY k.created_at, k.scope, k.key
    LIMIT list_keys.max_keys;
END;
$$;

COMMENT ON FUNCTION idempotency.list_keys(text, text, interval, boolean, integer) IS
'Stored keys for an operator, oldest first, without bodies or tokens: filter by scope, state
(in_progress, completed, released), older_than (age, 0 to 1000 years), expired_leases; at most
max_keys (1-10000). Reads every partition. Schema owner only. See docs/operations.md.';
