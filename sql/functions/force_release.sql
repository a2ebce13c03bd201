-- For operators (pg-idempotency keys release): release a key in progress without holding its
-- lease token, when the worker that holds it is gone and its lease is long (every retry gets
-- in_progress, 409, until the lease expires). The next claim runs afresh (outcome claimed),
-- without the recovery point. It goes through release() with the key's current token, so it is
-- fenced like any release: if a retry or a completer takes the key over meanwhile, it raises
-- IK001 and changes nothing. If the worker is in fact alive, its next fenced call (heartbeat,
-- checkpoint, complete) raises IK003 and its transaction rolls back. The schema owner's alone:
-- no grant_usage() kind includes it. Returns the lease token it released.
CREATE FUNCTION idempotency.force_release(scope text, key text)
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_token bigint;
BEGIN
    PERFORM idempotency._check_name('idempotency.force_release', 'scope', force_release.scope);
    PERFORM idempotency._check_name('idempotency.force_release', 'key', force_release.key);
    SELECT k.lease_token INTO v_token
    FROM idempotency.keys AS k
    WHERE k.scope = force_release.scope AND k.key = force_release.key;
    IF NOT FOUND THEN
        -- release() raises IK003 (no such key) with its usual message.
        v_token := 0;
    END IF;
    PERFORM idempotency.release(force_release.scope, force_release.key, v_token);
    RETURN v_token;
END;
$$;

COMMENT ON FUNCTION idempotency.force_release(text, text) IS
'Release a key in progress without its lease token (its worker is gone): the next claim runs
afresh. Fenced by the current token (IK001 if taken over meanwhile); IK003 no such key, IK004
completed. Schema owner only. Returns the released token. See docs/operations.md.';
