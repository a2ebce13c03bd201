-- For background completers (in any language) that drive abandoned work to an end without the
-- original request: takes over a key whose lease expired, like a retry would, but without the
-- fingerprint check. It never inserts, so it needs no key lock and runs at any isolation level
-- (under REPEATABLE READ a concurrent change makes it fail with 40001 rather than act twice).
CREATE FUNCTION idempotency.takeover(
    scope text,
    key text,
    lease interval DEFAULT '30 seconds',
    reference_time timestamptz DEFAULT NULL
)
RETURNS idempotency.claim_result
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER  -- for application roles without table privileges; see claim()
SET search_path = pg_catalog, pg_temp
-- A generic plan prunes the partitions of keys at executor startup; see docs/design.md.
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_now timestamptz := CASE WHEN takeover.reference_time IS NULL THEN clock_timestamp()
        ELSE idempotency._test_clock('idempotency.takeover', takeover.reference_time) END;
    v_created_at timestamptz;
    v_existing idempotency.keys;
    v_result idempotency.claim_result;
BEGIN
    PERFORM idempotency._check_name('idempotency.takeover', 'scope', takeover.scope);
    PERFORM idempotency._check_name('idempotency.takeover', 'key', takeover.key);
    PERFORM idempotency._check_lease('idempotency.takeover', 'lease', takeover.lease);
    -- A completer limited to some scopes (grant_usage(scopes => ...)) is refused any other
    -- (IK023) before anything is read.
    PERFORM idempotency._completer_scopes('idempotency.takeover', takeover.scope);

    FOR attempt IN 1 .. 5 LOOP
        -- The key's one partition, from the directory (see claim).
        SELECT d.created_at INTO v_created_at
        FROM idempotency.key_directory AS d
        WHERE d.scope = takeover.scope
          AND d.key_hash = sha256(convert_to(takeover.key, 'UTF8'));
        -- The row, from the one partition created_at names (see _make_routes).
        v_existing := idempotency._key_row(takeover.scope, takeover.key, v_created_at);
        -- A released key has no owner to take over from: the next claim() starts it afresh.
        IF v_existing.scope IS NULL OR v_existing.state = 'released' THEN
            RAISE EXCEPTION USING
                MESSAGE = format('idempotency.takeover: key %s in scope %s does not exist',
                                 to_json(takeover.key), to_json(takeover.scope)),
                ERRCODE = 'IK003',
                DETAIL = 'It was never claimed, was released, or is past retention.',
                HINT = 'Nothing to take over.';
        END IF;
        v_result := idempotency._resume_existing(v_existing, takeover.lease, v_now);
        IF v_result.outcome IS NOT NULL THEN
            RETURN v_result;
        END IF;
    END LOOP;
    v_result.outcome := 'in_progress';
    v_result.retry_after := takeover.lease;
    RETURN v_result;
END;
$$;

COMMENT ON FUNCTION idempotency.takeover(text, text, interval, timestamptz) IS
'Take over a key whose lease expired (outcome resumed, with a new token and the recovery point);
replay when completed, in_progress while the lease is live. Raises IK003 when the key does not
exist, IK023 when the caller is a completer limited to other scopes.';
