-- For a failure before any side effect: the key is forgotten, and the next retry runs afresh
-- (even with a different request). After a side effect, do not release: leave the lease to
-- expire so the next attempt resumes from the recovery point.
-- The row stays, in state released, until the next claim of the key replaces it (or maintain()
-- drops it with its partition): the next owner's token is made greater than this one's.
CREATE FUNCTION idempotency.release(scope text, key text, lease_token bigint)
RETURNS void
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
    IF NOT coalesce(idempotency._name_ok(release.scope) AND idempotency._name_ok(release.key)
                    AND release.lease_token IS NOT NULL, false) THEN
        PERFORM idempotency._check_name('idempotency.release', 'scope', release.scope);
        PERFORM idempotency._check_name('idempotency.release', 'key', release.key);
        IF release.lease_token IS NULL THEN
            PERFORM idempotency._invalid_argument('idempotency.release', 'lease_token', 'IK010',
                                                  'must not be NULL');
        END IF;
    END IF;

    -- The key's one partition, from the directory (see claim). A key not in the directory
    -- goes to the partition of now instead, so that the fenced UPDATE below probes a partition
    -- for it as for a key that exists: a wrong token costs the same work whatever the key's
    -- state (no timing oracle; see _lease_error and docs/design.md).
    SELECT d.created_at INTO v_created_at
    FROM idempotency.key_directory AS d
    WHERE d.scope = release.scope AND d.key_hash = sha256(convert_to(release.key, 'UTF8'));
    -- Unconditionally, so that both paths run the same statement.
    v_created_at := coalesce(v_created_at, clock_timestamp());

    -- The fenced UPDATE, on the one partition created_at names (see _make_routes).
    IF idempotency._release_row(release.scope, release.key, release.lease_token,
                                v_created_at) IS NULL THEN
        PERFORM idempotency._lease_error('idempotency.release', release.scope, release.key,
                                         release.lease_token);
    END IF;
END;
$$;

COMMENT ON FUNCTION idempotency.release(text, text, bigint) IS
'Forget a key you hold, after a failure with no side effect, so the next retry runs afresh.
Raises IK001 (not the key''s current token) or IK004 (completed with this token).';
