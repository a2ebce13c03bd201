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
-- A generic plan prunes the partitions of keys at executor startup; see docs/design.md.
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_now timestamptz := CASE WHEN heartbeat.reference_time IS NULL THEN clock_timestamp()
        ELSE idempotency._test_clock('idempotency.heartbeat', heartbeat.reference_time) END;
    v_created_at timestamptz;
    v_expires timestamptz;
BEGIN
    -- One inlined test for the common case; the checks inside it say what is wrong.
    -- coalesce: one NULL operand would make the whole test NULL, and IF NOT NULL skips.
    IF NOT coalesce(idempotency._name_ok(heartbeat.scope) AND idempotency._name_ok(heartbeat.key)
                    AND heartbeat.lease_token IS NOT NULL
                    AND idempotency._lease_ok(heartbeat.lease), false) THEN
        PERFORM idempotency._check_name('idempotency.heartbeat', 'scope', heartbeat.scope);
        PERFORM idempotency._check_name('idempotency.heartbeat', 'key', heartbeat.key);
        IF heartbeat.lease_token IS NULL THEN
            PERFORM idempotency._invalid_argument('idempotency.heartbeat', 'lease_token',
                                                  'IK010', 'must not be NULL');
        END IF;
        PERFORM idempotency._check_lease('idempotency.heartbeat', 'lease', heartbeat.lease);
    END IF;

    -- The key's one partition, from the directory (see claim). A key not in the directory
    -- goes to the partition of now instead, so that the fenced UPDATE below probes a partition
    -- for it as for a key that exists: a wrong token costs the same work whatever the key's
    -- state (no timing oracle; see _lease_error and docs/design.md).
    SELECT d.created_at INTO v_created_at
    FROM idempotency.key_directory AS d
    WHERE d.scope = heartbeat.scope AND d.key_hash = sha256(convert_to(heartbeat.key, 'UTF8'));
    -- Unconditionally, so that both paths run the same statement.
    v_created_at := coalesce(v_created_at, v_now);

    -- The fenced UPDATE, on the one partition created_at names (see _make_routes).
    v_expires := idempotency._heartbeat_row(heartbeat.scope, heartbeat.key,
                                            heartbeat.lease_token, v_created_at,
                                            v_now + heartbeat.lease);
    IF v_expires IS NULL THEN
        PERFORM idempotency._lease_error('idempotency.heartbeat', heartbeat.scope,
                                         heartbeat.key, heartbeat.lease_token);
    END IF;
    RETURN v_expires;
END;
$$;

COMMENT ON FUNCTION idempotency.heartbeat(text, text, bigint, interval, timestamptz) IS
'Extend the lease of a key you hold to at least now + lease; returns the new expiry. Raises
IK001 (not the key''s current token) or IK004 (completed with this token).';
