-- For operators (pg-idempotency keys show): everything stored about one key but its body,
-- unless body => true, and never its lease token (see sql/types/key_info.sql). The schema
-- owner's alone: no grant_usage() kind includes it, because it reads any scope's stored
-- responses. No row when the key is not stored (never claimed, or dropped after its retention);
-- a released key shows, in state released, until its next claim. The key is found as every
-- call finds it: its created_at from key_directory, then one partition of keys (on Citus, in
-- the scope's shard).
CREATE FUNCTION idempotency.inspect_key(scope text, key text, body boolean DEFAULT false)
RETURNS SETOF idempotency.key_info
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_created_at timestamptz;
BEGIN
    PERFORM idempotency._check_name('idempotency.inspect_key', 'scope', inspect_key.scope);
    PERFORM idempotency._check_name('idempotency.inspect_key', 'key', inspect_key.key);
    IF inspect_key.body IS NULL THEN
        PERFORM idempotency._invalid_argument('idempotency.inspect_key', 'body', 'IK010',
                                              'must not be NULL');
    END IF;
    SELECT d.created_at INTO v_created_at
    FROM idempotency.key_directory AS d
    WHERE d.scope = inspect_key.scope
      AND d.key_hash = idempotency._key_hash(inspect_key.key);
    IF NOT FOUND THEN
        RETURN;
    END IF;
    RETURN QUERY
    SELECT k.scope, k.key, k.state, k.lease_expires_at,
           k.state = 'in_progress' AND k.lease_expires_at <= clock_timestamp(),
           k.recovery_point, k.attempts, k.response_status, k.response_content_type,
           k.response_headers,
           coalesce(octet_length(k.response_body::text), octet_length(k.response_body_bytes)),
           CASE WHEN inspect_key.body THEN k.response_body END,
           CASE WHEN inspect_key.body THEN k.response_body_bytes END,
           k.created_at, k.completed_at, k.tableoid::regclass::text
    FROM idempotency.keys AS k
    WHERE k.scope = inspect_key.scope AND k.key = inspect_key.key
      AND k.created_at = v_created_at;
END;
$$;

COMMENT ON FUNCTION idempotency.inspect_key(text, text, boolean) IS
'One stored key for an operator (in progress, completed or released): state, lease expiry (never
the token), attempts, recovery point, stored status, timestamps, partition; the body only with
body => true. No row if not stored. Schema owner only. See docs/operations.md.';
