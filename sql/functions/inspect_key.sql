-- For operators (pg-idempotency keys show): everything stored about one key but its body,
-- unless body => true. The schema owner's alone: no grant_usage() kind includes it, because it
-- reads any scope's stored responses. No row when the key is not stored (never claimed,
-- released, or dropped after its retention).
CREATE FUNCTION idempotency.inspect_key(scope text, key text, body boolean DEFAULT false)
RETURNS SETOF idempotency.key_info
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM idempotency._check_name('idempotency.inspect_key', 'scope', inspect_key.scope);
    PERFORM idempotency._check_name('idempotency.inspect_key', 'key', inspect_key.key);
    IF inspect_key.body IS NULL THEN
        PERFORM idempotency._invalid_argument('idempotency.inspect_key', 'body', 'IK010',
                                              'must not be NULL');
    END IF;
    RETURN QUERY
    SELECT k.scope, k.key, k.state, k.lease_token, k.lease_expires_at,
           k.state = 'in_progress' AND k.lease_expires_at <= clock_timestamp(),
           k.recovery_point, k.attempts, k.response_status, k.response_content_type,
           k.response_headers,
           coalesce(octet_length(k.response_body::text), octet_length(k.response_body_bytes)),
           CASE WHEN inspect_key.body THEN k.response_body END,
           CASE WHEN inspect_key.body THEN k.response_body_bytes END,
           k.created_at, k.completed_at, k.tableoid::regclass::text
    FROM idempotency.keys AS k
    WHERE k.scope = inspect_key.scope AND k.key = inspect_key.key;
END;
$$;

COMMENT ON FUNCTION idempotency.inspect_key(text, text, boolean) IS
'One stored key for an operator: state, lease, attempts, recovery point, stored status,
timestamps, partition; the body only with body => true. No row if not stored. Schema owner
only. See docs/operations.md.';
