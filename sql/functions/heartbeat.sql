-- Keeps a lease alive during long work. The token, not the clock, decides ownership: a holder
-- whose lease ran out but was not taken over yet may still heartbeat and carry on.
CREATE FUNCTION idempotency.heartbeat(
    scope text,
    key text,
    lease_token bigint,
    lease interval DEFAULT '30 seconds',
    reference_time timestamptz DEFAULT NULL
)
RETURNS timestamptz
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER  -- for application roles without table privileges; see claim()
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now timestamptz := coalesce(heartbeat.reference_time, clock_timestamp());
    v_expires timestamptz;
BEGIN
    PERFORM idempotency._check_name('idempotency.heartbeat', 'scope', heartbeat.scope);
    PERFORM idempotency._check_name('idempotency.heartbeat', 'key', heartbeat.key);
    IF heartbeat.lease_token IS NULL THEN
        PERFORM idempotency._invalid_argument('idempotency.heartbeat', 'lease_token', 'IK010',
                                              'must not be NULL');
    END IF;
    PERFORM idempotency._check_lease('idempotency.heartbeat', 'lease', heartbeat.lease);

    UPDATE idempotency.keys AS k
    SET lease_expires_at = greatest(k.lease_expires_at, v_now + heartbeat.lease)
    WHERE k.scope = heartbeat.scope AND k.key = heartbeat.key
      AND k.lease_token = heartbeat.lease_token AND k.state = 'in_progress'
    RETURNING k.lease_expires_at INTO v_expires;
    IF NOT FOUND THEN
        PERFORM idempotency._lease_error('idempotency.heartbeat', heartbeat.scope,
                                         heartbeat.key, heartbeat.lease_token);
    END IF;
    RETURN v_expires;
END;
$$;

COMMENT ON FUNCTION idempotency.heartbeat(text, text, bigint, interval, timestamptz) IS
'Extend the lease of a key you hold to at least now + lease; returns the new expiry. Raises
IK001 (lease lost), IK003 (no such key) or IK004 (already completed).';
