-- For long-running operations: the owner answers "202 Accepted" now and finishes later (a worker
-- that heartbeats the lease and calls complete). Call it in the transaction that hands the work
-- over (the one that enqueues the job), so that the hand-off and the interim response commit
-- together or not at all. Until complete, a claim of the key under a live lease returns outcome
-- accepted with this response instead of in_progress, so every retry gets the same answer.
--
-- Storage: the interim response lives in the response_* columns of the row, which stays
-- in_progress (no column of its own: complete() overwrites them with the final response, and a
-- row is "accepted" exactly when it is in progress with response_status set). Fenced like
-- complete(): a stale token raises IK001 (IK004 if it completed the key) and the hand-off rolls
-- back with it.
CREATE FUNCTION idempotency.accept(
    scope text,
    key text,
    lease_token bigint,
    status integer,
    body jsonb,
    headers jsonb DEFAULT '{}',
    lease interval DEFAULT NULL,
    reference_time timestamptz DEFAULT NULL
)
RETURNS timestamptz
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER  -- for application roles without table privileges; see claim()
SET search_path = pg_catalog, pg_temp
-- A generic plan prunes the partitions of keys at executor startup; see docs/design.md.
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_size integer;  -- _raw_size's, assigned before the PERFORM that uses it (see there)
    v_now timestamptz := CASE WHEN accept.reference_time IS NULL THEN clock_timestamp()
        ELSE idempotency._test_clock('idempotency.accept', accept.reference_time) END;
    v_created_at timestamptz;
    v_headers jsonb := coalesce(accept.headers, '{}');
    v_expires timestamptz;
BEGIN
    -- One inlined test for the common case; the checks below it say what is wrong.
    -- coalesce: one NULL operand would make the whole test NULL, and IF NOT NULL skips.
    -- Sizes first, as in complete(), uncompressed (a value read from a table may be
    -- compressed: _raw_size).
    IF NOT coalesce(idempotency._name_ok(accept.scope) AND idempotency._name_ok(accept.key)
                    AND accept.lease_token IS NOT NULL AND accept.status BETWEEN 100 AND 599
                    AND (accept.body IS NULL OR pg_column_size(accept.body) <= 65536
                         AND pg_column_compression(accept.body) IS NULL)
                    AND pg_column_size(v_headers) <= 4096
                    AND pg_column_compression(v_headers) IS NULL
                    AND idempotency._headers_ok(v_headers)
                    AND (accept.lease IS NULL OR idempotency._lease_ok(accept.lease)),
                    false) THEN
        IF pg_column_size(accept.body) > 65536
           OR pg_column_compression(accept.body) IS NOT NULL THEN
            v_size := idempotency._raw_size(accept.body);
            PERFORM idempotency._check_size('idempotency.accept', 'body', v_size,
                                            'max_response_bytes');
        END IF;
        IF pg_column_size(v_headers) > 4096 OR pg_column_compression(v_headers) IS NOT NULL THEN
            v_size := idempotency._raw_size(v_headers);
            PERFORM idempotency._check_size('idempotency.accept', 'headers', v_size,
                                            'max_headers_bytes');
        END IF;
        PERFORM idempotency._check_response('idempotency.accept', accept.scope, accept.key,
                                            accept.lease_token, accept.status, v_headers);
        IF accept.lease IS NOT NULL THEN
            PERFORM idempotency._check_lease('idempotency.accept', 'lease', accept.lease);
        END IF;
    END IF;

    -- The key's one partition, from the directory (see claim).
    SELECT d.created_at INTO v_created_at
    FROM idempotency.key_directory AS d
    WHERE d.scope = accept.scope AND d.key_hash = sha256(convert_to(accept.key, 'UTF8'));
    -- An absent key probes the partition of now, as an existing key probes its own: no
    -- timing difference for a wrong token to read (docs/design.md).
    v_created_at := coalesce(v_created_at, v_now);

    -- The fenced UPDATE, on the one partition created_at names (see _make_routes); a NULL
    -- expiry (no lease given) keeps the lease as it is.
    v_expires := idempotency._accept_row(accept.scope, accept.key, accept.lease_token,
                                         v_created_at, accept.status, v_headers, accept.body,
                                         v_now + accept.lease);
    IF v_expires IS NULL THEN
        PERFORM idempotency._lease_error('idempotency.accept', accept.scope, accept.key,
                                         accept.lease_token);
    END IF;
    RETURN v_expires;
END;
$$;

COMMENT ON FUNCTION idempotency.accept(
    text, text, bigint, integer, jsonb, jsonb, interval, timestamptz
) IS
'Store an interim response (e.g. 202 Accepted with a status URL) on a key you hold, in the
transaction that hands the work over; optionally extend the lease to at least now + lease.
Returns the lease expiry. Until complete(), claims under a live lease get outcome accepted with
this response. Raises IK001 (not the key''s current token) or IK004 (completed with this token).';
