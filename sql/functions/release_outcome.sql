-- release() with the lost lease as an answer, not an error (see heartbeat_outcome
-- for why on Citus): 'ok', or 'lease_lost' / 'completed' where release raises IK001 / IK004.
-- release writes nothing else of the caller's, so nothing needs the error's rollback. Bad
-- arguments still raise. Keep the body in step with release.sql.
CREATE FUNCTION idempotency.release_outcome(scope text, key text, lease_token bigint)
RETURNS idempotency.lease_outcome
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER  -- for application roles without table privileges; see claim()
SET search_path = pg_catalog, pg_temp
-- A generic plan prunes the partitions of keys at executor startup; see docs/design.md.
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_created_at timestamptz;
BEGIN
    -- One inlined test for the common case; the checks inside it say what is wrong.
    -- coalesce: one NULL operand would make the whole test NULL, and IF NOT NULL skips.
    IF NOT coalesce(idempotency._name_ok(release_outcome.scope)
                    AND idempotency._name_ok(release_outcome.key)
                    AND release_outcome.lease_token IS NOT NULL, false) THEN
        PERFORM idempotency._check_name('idempotency.release_outcome', 'scope',
                                        release_outcome.scope);
        PERFORM idempotency._check_name('idempotency.release_outcome', 'key',
                                        release_outcome.key);
        IF release_outcome.lease_token IS NULL THEN
            PERFORM idempotency._invalid_argument('idempotency.release_outcome', 'lease_token',
                                                  'IK010', 'must not be NULL');
        END IF;
    END IF;

    -- The key's one partition, from the directory (see claim). A key not in the directory
    -- goes to the partition of now instead, so that the fenced UPDATE below probes a partition
    -- for it as for a key that exists: a wrong token costs the same work whatever the key's
    -- state (no timing oracle; see _lease_error and docs/design.md).
    SELECT d.created_at INTO v_created_at
    FROM idempotency.key_directory AS d
    WHERE d.scope = release_outcome.scope
      AND d.key_hash = sha256(convert_to(release_outcome.key, 'UTF8'));
    -- Unconditionally, so that both paths run the same statement.
    v_created_at := coalesce(v_created_at, clock_timestamp());

    -- The fenced UPDATE, on the one partition created_at names (see _make_routes).
    IF idempotency._release_row(release_outcome.scope, release_outcome.key,
                                release_outcome.lease_token, v_created_at) IS NOT NULL THEN
        RETURN ROW('ok', NULL)::idempotency.lease_outcome;
    END IF;
    RETURN ROW(idempotency._lease_outcome(release_outcome.scope, release_outcome.key,
                                          release_outcome.lease_token),
               NULL)::idempotency.lease_outcome;
END;
$$;

COMMENT ON FUNCTION idempotency.release_outcome(text, text, bigint) IS
'release() answering with an outcome instead of an error: ok, lease_lost (where release raises
IK001) or completed (IK004). Raises only for bad arguments. On Citus an error costs the session
a new worker connection; an outcome does not.';
