-- Called when a fenced write (checkpoint, heartbeat, accept, complete, release) matched no row:
-- raises the documented error. Raising, not returning false, is the point: the caller's
-- business writes in the same transaction must roll back with it. (heartbeat_outcome,
-- checkpoint_outcome and release_outcome answer the same as an outcome instead, for callers
-- that roll back themselves: on Citus an error costs a new worker connection.)
--
-- No oracle: unless the caller's token is the key's own, the answer is IK001 with the same text
-- whether the key is in progress under another token, completed, released or absent. So a
-- caller that knows (or guesses) another scope's key learns nothing about it from a wrong
-- token (before 0.9.0, IK003 / IK001 / IK004 told absent, in progress and completed apart).
-- Only the owner, whose token matches, is told that its key is already completed (IK004).
--
-- No timing oracle either: the callers (heartbeat, checkpoint, release, accept, complete,
-- complete_bytes) and _lease_outcome send a key missing from key_directory to the partition of
-- now, so a wrong token runs the same statements, probing the same indexes, whether the key is
-- absent, in progress, completed or released. What remains is measured in
-- tests/probes/test_timing_oracle.py and explained in docs/design.md ("No timing oracle").
CREATE FUNCTION idempotency._lease_error(
    fn text, scope text, key text, lease_token bigint
)
RETURNS void
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- The lookup is _lease_outcome's, shared with the functions that answer an outcome.
    IF idempotency._lease_outcome(_lease_error.scope, _lease_error.key,
                                  _lease_error.lease_token) = 'completed' THEN
        RAISE EXCEPTION USING
            MESSAGE = format('%s: key %s in scope %s is already completed', _lease_error.fn,
                             to_json(_lease_error.key), to_json(_lease_error.scope)),
            ERRCODE = 'IK004',
            DETAIL = 'It was completed with this lease token.',
            HINT = 'Roll back; a retry will replay the stored response.';
    END IF;
    RAISE EXCEPTION USING
        MESSAGE = format('%s: lease token %s is not the current one for key %s in scope %s',
                         _lease_error.fn, _lease_error.lease_token,
                         to_json(_lease_error.key), to_json(_lease_error.scope)),
        ERRCODE = 'IK001',
        DETAIL = 'The lease was lost (taken over after it expired, or released), or the key or '
                 'the token is not one this caller was given.',
        HINT = 'Roll back: whoever holds the current token owns the key.';
END;
$$;

COMMENT ON FUNCTION idempotency._lease_error(text, text, text, bigint) IS
'Internal: raise IK004 (completed with this token) or IK001 (any other case, the same for every
key state) for a fenced write that matched no row.';
