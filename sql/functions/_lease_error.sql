-- Called when a fenced write (checkpoint, heartbeat, complete, release) matched no row: finds
-- out why and raises the documented error. Raising, not returning false, is the point: the
-- caller's business writes in the same transaction must roll back with it.
CREATE FUNCTION idempotency._lease_error(
    fn text, scope text, key text, lease_token bigint
)
RETURNS void
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
-- A generic plan prunes the partitions of keys at executor startup; see docs/design.md.
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_state text;
    v_token bigint;
    v_created_at timestamptz;
BEGIN
    SELECT d.created_at INTO v_created_at
    FROM idempotency.key_directory AS d
    WHERE d.scope = _lease_error.scope
      AND d.key_hash = sha256(convert_to(_lease_error.key, 'UTF8'));
    SELECT k.state, k.lease_token INTO v_state, v_token
    FROM idempotency.keys AS k
    WHERE k.scope = _lease_error.scope AND k.key = _lease_error.key
      AND k.created_at = v_created_at;

    IF NOT FOUND THEN
        RAISE EXCEPTION USING
            MESSAGE = format('%s: key %s in scope %s does not exist', _lease_error.fn,
                             to_json(_lease_error.key), to_json(_lease_error.scope)),
            ERRCODE = 'IK003',
            DETAIL = 'It was never claimed, was released, or is past retention.',
            HINT = 'Claim the key again with idempotency.claim().';
    ELSIF v_state = 'completed' THEN
        RAISE EXCEPTION USING
            MESSAGE = format('%s: key %s in scope %s is already completed', _lease_error.fn,
                             to_json(_lease_error.key), to_json(_lease_error.scope)),
            ERRCODE = 'IK004',
            DETAIL = CASE WHEN v_token = _lease_error.lease_token
                THEN 'It was completed with this lease token.'
                ELSE 'It was completed by another lease holder.' END,
            HINT = 'Roll back; a retry will replay the stored response.';
    ELSE
        RAISE EXCEPTION USING
            MESSAGE = format('%s: lease token %s is no longer current for key %s in scope %s',
                             _lease_error.fn, _lease_error.lease_token,
                             to_json(_lease_error.key), to_json(_lease_error.scope)),
            ERRCODE = 'IK001',
            DETAIL = 'The lease expired and was taken over by a newer attempt.',
            HINT = 'Roll back: the newer lease holder owns the key now.';
    END IF;
END;
$$;

COMMENT ON FUNCTION idempotency._lease_error(text, text, text, bigint) IS
'Internal: raise IK001, IK003 or IK004 for a fenced write that matched no row.';
