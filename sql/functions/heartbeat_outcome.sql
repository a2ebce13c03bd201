-- heartbeat() with the lost lease as an answer, not an error: the same checks, the
-- same statements, the same answers, but 'lease_lost' / 'completed' come back as the outcome
-- instead of IK001 / IK004. Through a Citus coordinator every error raised on a worker makes
-- Citus drop the session's connection to that worker, so the next call opens a new one (a
-- new worker backend, far dearer than the answer: tests/citus/test_citus_error_cost.py); an
-- old owner that heartbeats after a takeover is a common answer, not an exception. heartbeat
-- writes nothing of the caller's, so nothing needs the error's rollback. Bad arguments still
-- raise (a caller's bug). Keep the body in step with heartbeat.sql: the timing-oracle
-- property (the same statements for every key state) holds for both.
CREATE FUNCTION idempotency.heartbeat_outcome(
    scope text,
    key text,
    lease_token bigint,
    lease interval DEFAULT '30 seconds',
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
    v_now timestamptz := CASE WHEN heartbeat_outcome.reference_time IS NULL
        THEN clock_timestamp()
        ELSE idempotency._test_clock('idempotency.heartbeat_outcome',
                                     heartbeat_outcome.reference_time) END;
    v_created_at timestamptz;
    v_expires timestamptz;
BEGIN
    -- One inlined test for the common case; the checks inside it say what is wrong.
    -- coalesce: one NULL operand would make the whole test NULL, and IF NOT NULL skips.
    IF NOT coalesce(idempotency._name_ok(heartbeat_outcome.scope)
                    AND idempotency._name_ok(heartbeat_outcome.key)
                    AND heartbeat_outcome.lease_token IS NOT NULL
                    AND idempotency._lease_ok(heartbeat_outcome.lease), false) THEN
        PERFORM idempotency._check_name('idempotency.heartbeat_outcome', 'scope',
                                        heartbeat_outcome.scope);
        PERFORM idempotency._check_name('idempotency.heartbeat_outcome', 'key',
                                        heartbeat_outcome.key);
        IF heartbeat_outcome.lease_token IS NULL THEN
            PERFORM idempotency._invalid_argument('idempotency.heartbeat_outcome',
                                                  'lease_token', 'IK010', 'must not be NULL');
        END IF;
        PERFORM idempotency._check_lease('idempotency.heartbeat_outcome', 'lease',
                                         heartbeat_outcome.lease);
    END IF;

    -- The key's one partition, from the directory (see claim). A key not in the directory
    -- goes to the partition of now instead, so that the fenced UPDATE below probes a partition
    -- for it as for a key that exists: a wrong token costs the same work whatever the key's
    -- state (no timing oracle; see _lease_error and docs/design.md).
    SELECT d.created_at INTO v_created_at
    FROM idempotency.key_directory AS d
    WHERE d.scope = heartbeat_outcome.scope
      AND d.key_hash = sha256(convert_to(heartbeat_outcome.key, 'UTF8'));
    -- Unconditionally, so that both paths run the same statement.
    v_created_at := coalesce(v_created_at, v_now);

    -- The fenced UPDATE, on the one partition created_at names (see _make_routes).
    v_expires := idempotency._heartbeat_row(heartbeat_outcome.scope, heartbeat_outcome.key,
                                            heartbeat_outcome.lease_token, v_created_at,
                                            v_now + heartbeat_outcome.lease);
    IF v_expires IS NOT NULL THEN
        RETURN ROW('ok', v_expires)::idempotency.lease_outcome;
    END IF;
    RETURN ROW(idempotency._lease_outcome(heartbeat_outcome.scope, heartbeat_outcome.key,
                                          heartbeat_outcome.lease_token),
               NULL)::idempotency.lease_outcome;
END;
$$;

COMMENT ON FUNCTION idempotency.heartbeat_outcome(text, text, bigint, interval, timestamptz) IS
'heartbeat() answering with an outcome instead of an error: ok with the new lease expiry,
lease_lost (where heartbeat raises IK001) or completed (IK004). Raises only for bad arguments.
On Citus an error costs the session a new worker connection; an outcome does not.';
