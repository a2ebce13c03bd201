-- checkpoint() with the lost lease as an answer, not an error (see
-- heartbeat_outcome for why on Citus). Unlike checkpoint(), a lost lease does not abort the
-- caller's transaction: the caller must roll back the step's writes itself on any outcome but
-- 'ok' (the Python package's Operation does, then raises LeaseLost). For a caller that cannot
-- promise that, checkpoint() stays the right call. Keep the body in step with checkpoint.sql.
CREATE FUNCTION idempotency.checkpoint_outcome(
    scope text,
    key text,
    lease_token bigint,
    recovery_point text,
    extend interval DEFAULT NULL,
    reference_time timestamptz DEFAULT NULL
)
RETURNS idempotency.lease_outcome
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER  -- for application roles without table privileges; see claim()
SET search_path = pg_catalog, pg_temp
-- A generic plan prunes the partitions of keys at executor startup; see docs/design.md.
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_now timestamptz := CASE WHEN checkpoint_outcome.reference_time IS NULL
        THEN clock_timestamp()
        ELSE idempotency._test_clock('idempotency.checkpoint_outcome',
                                     checkpoint_outcome.reference_time) END;
    v_created_at timestamptz;
    v_expires timestamptz;
BEGIN
    -- One inlined test for the common case; the checks inside it say what is wrong.
    -- coalesce: one NULL operand would make the whole test NULL, and IF NOT NULL skips.
    IF NOT coalesce(idempotency._name_ok(checkpoint_outcome.scope)
                    AND idempotency._name_ok(checkpoint_outcome.key)
                    AND checkpoint_outcome.lease_token IS NOT NULL
                    AND idempotency._name_ok(checkpoint_outcome.recovery_point)
                    AND (checkpoint_outcome.extend IS NULL
                         OR idempotency._lease_ok(checkpoint_outcome.extend)), false) THEN
        PERFORM idempotency._check_name('idempotency.checkpoint_outcome', 'scope',
                                        checkpoint_outcome.scope);
        PERFORM idempotency._check_name('idempotency.checkpoint_outcome', 'key',
                                        checkpoint_outcome.key);
        IF checkpoint_outcome.lease_token IS NULL THEN
            PERFORM idempotency._invalid_argument('idempotency.checkpoint_outcome',
                                                  'lease_token', 'IK010', 'must not be NULL');
        END IF;
        PERFORM idempotency._check_name('idempotency.checkpoint_outcome', 'recovery_point',
                                        checkpoint_outcome.recovery_point);
        IF checkpoint_outcome.extend IS NOT NULL THEN
            PERFORM idempotency._check_lease('idempotency.checkpoint_outcome', 'extend',
                                             checkpoint_outcome.extend);
        END IF;
    END IF;

    -- The key's one partition, from the directory (see claim). A key not in the directory
    -- goes to the partition of now instead, so that the fenced UPDATE below probes a partition
    -- for it as for a key that exists: a wrong token costs the same work whatever the key's
    -- state (no timing oracle; see _lease_error and docs/design.md).
    SELECT d.created_at INTO v_created_at
    FROM idempotency.key_directory AS d
    WHERE d.scope = checkpoint_outcome.scope
      AND d.key_hash = sha256(convert_to(checkpoint_outcome.key, 'UTF8'));
    -- Unconditionally, so that both paths run the same statement.
    v_created_at := coalesce(v_created_at, v_now);

    -- The fenced UPDATE, on the one partition created_at names (see _make_routes); a NULL
    -- expiry (no extend) keeps the lease as it is.
    v_expires := idempotency._checkpoint_row(checkpoint_outcome.scope, checkpoint_outcome.key,
                                             checkpoint_outcome.lease_token, v_created_at,
                                             checkpoint_outcome.recovery_point,
                                             v_now + checkpoint_outcome.extend);
    IF v_expires IS NOT NULL THEN
        RETURN ROW('ok', v_expires)::idempotency.lease_outcome;
    END IF;
    RETURN ROW(idempotency._lease_outcome(checkpoint_outcome.scope, checkpoint_outcome.key,
                                          checkpoint_outcome.lease_token),
               NULL)::idempotency.lease_outcome;
END;
$$;

COMMENT ON FUNCTION idempotency.checkpoint_outcome(
    text, text, bigint, text, interval, timestamptz
) IS
'checkpoint() answering with an outcome instead of an error: ok with the lease expiry,
lease_lost (where checkpoint raises IK001) or completed (IK004). Then nothing was recorded, and
the caller must roll back its own writes of this transaction itself. Raises only for bad
arguments. On Citus an error costs the session a new worker connection; an outcome does not.';
