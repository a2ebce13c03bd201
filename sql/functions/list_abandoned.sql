-- Keys whose lease expired while in progress, oldest expiry first. The rows stay locked
-- (FOR UPDATE SKIP LOCKED) until the caller's transaction ends, so several completers can each
-- take a disjoint batch and call takeover() on it in the same transaction.
CREATE FUNCTION idempotency.list_abandoned(
    max_keys integer DEFAULT 100,
    scope text DEFAULT NULL,
    reference_time timestamptz DEFAULT NULL
)
RETURNS SETOF idempotency.abandoned_key
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER  -- for application roles without table privileges; see claim()
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now timestamptz;
    v_candidate record;
    v_row idempotency.abandoned_key;
    v_found integer := 0;
    v_scopes text[];
BEGIN
    IF list_abandoned.max_keys IS NULL THEN
        PERFORM idempotency._invalid_argument('idempotency.list_abandoned', 'max_keys', 'IK010',
                                              'must not be NULL');
    ELSIF list_abandoned.max_keys NOT BETWEEN 1 AND 10000 THEN
        PERFORM idempotency._invalid_argument('idempotency.list_abandoned', 'max_keys', 'IK014',
                                              'must be between 1 and 10000',
                                              format('It is %s.', list_abandoned.max_keys));
    END IF;
    IF list_abandoned.scope IS NOT NULL THEN
        PERFORM idempotency._check_name('idempotency.list_abandoned', 'scope',
                                        list_abandoned.scope);
    END IF;
    -- A completer limited to some scopes (grant_usage(scopes => ...)): IK023 for another
    -- scope; without scope, only its own are listed. NULL: every scope.
    v_scopes := idempotency._completer_scopes('idempotency.list_abandoned',
                                              list_abandoned.scope);
    v_now := CASE WHEN list_abandoned.reference_time IS NULL THEN clock_timestamp()
        ELSE idempotency._test_clock('idempotency.list_abandoned',
                                     list_abandoned.reference_time) END;

    -- Candidates first, without locks, then each one locked on its own (SKIP LOCKED): on
    -- Citus a statement over every shard cannot lock rows, one on a scope's shard can. On one
    -- node it costs a statement per key, for a call background completers make rarely.
    FOR v_candidate IN
        SELECT k.scope, k.key, k.created_at
        FROM idempotency.keys AS k
        WHERE k.state = 'in_progress' AND k.lease_expires_at <= v_now
          AND (list_abandoned.scope IS NULL OR k.scope = list_abandoned.scope)
          AND (v_scopes IS NULL OR k.scope = ANY (v_scopes))
        ORDER BY k.lease_expires_at
        -- Room for keys other completers hold locked, which are skipped.
        LIMIT list_abandoned.max_keys * 4
    LOOP
        SELECT k.scope, k.key, k.lease_expires_at, k.recovery_point, k.attempts, k.created_at
        INTO v_row
        FROM idempotency.keys AS k
        WHERE k.scope = v_candidate.scope AND k.key = v_candidate.key
          AND k.created_at = v_candidate.created_at
          AND k.state = 'in_progress' AND k.lease_expires_at <= v_now
        FOR UPDATE OF k SKIP LOCKED;
        IF FOUND THEN
            RETURN NEXT v_row;
            v_found := v_found + 1;
            EXIT WHEN v_found >= list_abandoned.max_keys;
        END IF;
    END LOOP;
END;
$$;

COMMENT ON FUNCTION idempotency.list_abandoned(integer, text, timestamptz) IS
'Up to max_keys in-progress keys whose lease expired (optionally of one scope; for a completer
limited to some scopes, of those only, IK023 for another), oldest expiry first, locked FOR
UPDATE SKIP LOCKED until the end of the caller''s transaction.';
