-- Records how far the operation got, in the caller's transaction: the step's own writes and the
-- recovery point commit together or not at all, so a worker that takes the key over after a
-- crash sees exactly the steps whose effects are durable. Fenced: a stale token raises.
CREATE FUNCTION idempotency.checkpoint(
    scope text,
    key text,
    lease_token bigint,
    recovery_point text,
    extend interval DEFAULT NULL,
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
    v_now timestamptz := CASE WHEN checkpoint.reference_time IS NULL THEN clock_timestamp()
        ELSE idempotency._test_clock('idempotency.checkpoint', checkpoint.reference_time) END;
    v_created_at timestamptz;
    v_expires timestamptz;
BEGIN
    -- One inlined test for the common case; the checks inside it say what is wrong.
    -- coalesce: one NULL operand would make the whole test NULL, and IF NOT NULL skips.
    IF NOT coalesce(idempotency._name_ok(checkpoint.scope)
                    AND idempotency._name_ok(checkpoint.key)
                    AND checkpoint.lease_token IS NOT NULL
                    AND idempotency._name_ok(checkpoint.recovery_point)
                    AND (checkpoint.extend IS NULL
                         OR idempotency._lease_ok(checkpoint.extend)), false) THEN
        PERFORM idempotency._check_name('idempotency.checkpoint', 'scope', checkpoint.scope);
        PERFORM idempotency._check_name('idempotency.checkpoint', 'key', checkpoint.key);
        IF checkpoint.lease_token IS NULL THEN
            PERFORM idempotency._invalid_argument('idempotency.checkpoint', 'lease_token',
                                                  'IK010', 'must not be NULL');
        END IF;
        PERFORM idempotency._check_name('idempotency.checkpoint', 'recovery_point',
                                        checkpoint.recovery_point);
        IF checkpoint.extend IS NOT NULL THEN
            PERFORM idempotency._check_lease('idempotency.checkpoint', 'extend',
                                             checkpoint.extend);
        END IF;
    END IF;

    -- The key's one partition, from the directory (see claim). A key not in the directory
    -- goes to the partition of now instead, so that the fenced UPDATE below probes a partition
    -- for it as for a key that exists: a wrong token costs the same work whatever the key's
    -- state (no timing oracle; see _lease_error and docs/design.md).
    SELECT d.created_at INTO v_created_at
    FROM idempotency.key_directory AS d
    WHERE d.scope = checkpoint.scope AND d.key_hash = sha256(convert_to(checkpoint.key, 'UTF8'));
    -- Unconditionally, so that both paths run the same statement.
    v_created_at := coalesce(v_created_at, v_now);

    -- The fenced UPDATE, on the one partition created_at names (see _make_routes); a NULL
    -- expiry (no extend) keeps the lease as it is.
    v_expires := idempotency._checkpoint_row(checkpoint.scope, checkpoint.key,
                                             checkpoint.lease_token, v_created_at,
                                             checkpoint.recovery_point,
                                             v_now + checkpoint.extend);
    IF v_expires IS NULL THEN
        PERFORM idempotency._lease_error('idempotency.checkpoint', checkpoint.scope,
                                         checkpoint.key, checkpoint.lease_token);
    END IF;
    RETURN v_expires;
END;
$$;

COMMENT ON FUNCTION idempotency.checkpoint(text, text, bigint, text, interval, timestamptz) IS
'Record recovery_point for a key you hold (in your transaction, with that step''s writes),
optionally extending the lease to at least now + extend. Returns the lease expiry. Raises IK001
(not the key''s current token) or IK004 (completed with this token).';
