-- Why a fenced write matched no row: 'completed' when the caller's token is the one that
-- completed the key, 'lease_lost' in every other case (in progress under another token,
-- released, completed by another attempt, absent). _lease_error raises IK004 / IK001 from it;
-- heartbeat_outcome, checkpoint_outcome and release_outcome return it as their outcome.
--
-- No oracle: only the owner of the completing token learns more than 'lease_lost'. No timing
-- oracle: a key missing from key_directory is looked for in the partition of now, so the same
-- statements probe the same indexes whatever the key's state (see _lease_error and
-- docs/design.md, "No timing oracle").
CREATE FUNCTION idempotency._lease_outcome(scope text, key text, lease_token bigint)
RETURNS text
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
-- A generic plan prunes the partitions of keys at executor startup; see docs/design.md.
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_created_at timestamptz;
BEGIN
    SELECT d.created_at INTO v_created_at
    FROM idempotency.key_directory AS d
    WHERE d.scope = _lease_outcome.scope
      AND d.key_hash = sha256(convert_to(_lease_outcome.key, 'UTF8'));
    -- A key not in the directory is looked for in the partition of now, so that the lookup
    -- below probes a partition whatever the key's state (see the header).
    v_created_at := coalesce(v_created_at, clock_timestamp());
    PERFORM
    FROM idempotency.keys AS k
    WHERE k.scope = _lease_outcome.scope AND k.key = _lease_outcome.key
      AND k.created_at = v_created_at AND k.lease_token = _lease_outcome.lease_token
      AND k.state = 'completed';
    RETURN CASE WHEN FOUND THEN 'completed' ELSE 'lease_lost' END;
END;
$$;

COMMENT ON FUNCTION idempotency._lease_outcome(text, text, bigint) IS
'Internal: completed (the key was completed with this token) or lease_lost (any other case, the
same for every key state), for a fenced write that matched no row.';
