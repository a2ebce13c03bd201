-- For operators (pg-idempotency keys release): release a key in progress without holding its
-- lease token, when the worker that holds it is gone and its lease is long (every retry gets
-- in_progress, 409, until the lease expires). The key is left in state released, as by
-- release(): the next claim runs afresh (outcome claimed), without the recovery point. It goes
-- through release() with the key's current token, read here, so it is fenced like any release:
-- if a retry or a completer takes the key over meanwhile, release() raises IK001 and nothing
-- changes. If the worker is in fact alive, its next fenced call (heartbeat, checkpoint,
-- complete) raises IK001 and its transaction rolls back.
-- The schema owner's alone: no grant_usage() kind includes it (tests/sql/40_privileges.sql).
-- It tells absent and completed keys apart (IK003, IK004), which release() no longer does for
-- callers without the token: an operator may know that, an application role may not. It
-- returns nothing, so it hands out no token either.
CREATE FUNCTION idempotency.force_release(scope text, key text)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_created_at timestamptz;
    v_state text;
    v_token bigint;
BEGIN
    PERFORM idempotency._check_name('idempotency.force_release', 'scope', force_release.scope);
    PERFORM idempotency._check_name('idempotency.force_release', 'key', force_release.key);
    SELECT d.created_at INTO v_created_at
    FROM idempotency.key_directory AS d
    WHERE d.scope = force_release.scope
      AND d.key_hash = idempotency._key_hash(force_release.key);
    SELECT k.state, k.lease_token INTO v_state, v_token
    FROM idempotency.keys AS k
    WHERE k.scope = force_release.scope AND k.key = force_release.key
      AND k.created_at = v_created_at;
    IF v_state IS NULL OR v_state = 'released' THEN
        RAISE EXCEPTION USING
            MESSAGE = format('idempotency.force_release: no key %s in progress in scope %s',
                             to_json(force_release.key), to_json(force_release.scope)),
            ERRCODE = 'IK003',
            DETAIL = CASE WHEN v_state IS NOT NULL THEN 'It is released already.'
                          ELSE 'It was never claimed, or is past its retention.' END,
            HINT = 'Nothing to release: the next claim of the key runs afresh.';
    ELSIF v_state = 'completed' THEN
        RAISE EXCEPTION USING
            MESSAGE = format('idempotency.force_release: key %s in scope %s is completed',
                             to_json(force_release.key), to_json(force_release.scope)),
            ERRCODE = 'IK004',
            DETAIL = 'A completed key keeps its response until its retention ends.',
            HINT = 'Nothing to release: retries replay the stored response.';
    END IF;
    PERFORM idempotency.release(force_release.scope, force_release.key, v_token);
END;
$$;

COMMENT ON FUNCTION idempotency.force_release(text, text) IS
'Release a key in progress without its lease token (its worker is gone): the key is left
released and the next claim runs afresh. Fenced by the current token (IK001 if taken over
meanwhile); IK003 not in progress (absent or released), IK004 completed. Schema owner only.
See docs/operations.md.';
