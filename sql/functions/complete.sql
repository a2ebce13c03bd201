-- Call inside the business transaction, after its writes: the response becomes replayable in
-- the same commit as the effect it describes.
--
-- The fenced UPDATE is the generated route _complete_row (see _make_routes): it matches only
-- while the caller's token is still the key's token; otherwise _lease_error raises, and the
-- caller's business writes in the same transaction roll back with it, so a stale worker can
-- never commit a completion. The route finds the key's partition by the completion's time
-- first (its guess), and reads key_directory only when that misses. Two PL/pgSQL levels on the
-- success path: 0.10.0 had three (through _finish) and always read the directory.
CREATE FUNCTION idempotency.complete(
    scope text,
    key text,
    lease_token bigint,
    status integer,
    body jsonb,
    headers jsonb DEFAULT '{}',
    reference_time timestamptz DEFAULT NULL
)
RETURNS timestamptz
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER  -- for application roles without table privileges; see claim()
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_size integer;  -- _raw_size's, assigned before the PERFORM that uses it (see there)
    v_now timestamptz;
    v_completed timestamptz;
BEGIN
    -- One inlined test for the common call (PL/pgSQL builds each expression's executor state
    -- once per transaction, and pays for every function it calls: see claim); the
    -- branch below checks in the documented order and says what is wrong. coalesce: one NULL
    -- operand would make the whole test NULL. The form of the scope and the key (a regex
    -- each, the costliest checks) and the token's NULL are left to the miss
    -- below; the scope's NULL stays here, so that no statement of the route runs without the
    -- scope that places it (on Citus, its shard). headers NULL takes the branch, which makes
    -- it '{}'. The sizes come first there (before the headers' jsonpath test reads them):
    -- above the smallest limits allowed (64 KiB, 4 KiB) the settings decide (_check_size),
    -- before anything is stored. A compressed value (read from a table, never one the client
    -- sent) takes the branch too, which measures it uncompressed (_raw_size): the common call
    -- pays a header test.
    IF NOT coalesce(complete.reference_time IS NULL AND complete.scope IS NOT NULL
                    AND complete.status BETWEEN 100 AND 599
                    AND (complete.body IS NULL OR pg_column_size(complete.body) <= 65536
                         AND pg_column_compression(complete.body) IS NULL)
                    AND pg_column_size(complete.headers) <= 4096
                    AND pg_column_compression(complete.headers) IS NULL
                    AND idempotency._headers_ok(complete.headers), false) THEN
        complete.headers := coalesce(complete.headers, '{}');
        IF pg_column_size(complete.body) > 65536
           OR pg_column_compression(complete.body) IS NOT NULL THEN
            v_size := idempotency._raw_size(complete.body);
            PERFORM idempotency._check_size('idempotency.complete', 'body', v_size,
                                            'max_response_bytes');
        END IF;
        IF pg_column_size(complete.headers) > 4096
           OR pg_column_compression(complete.headers) IS NOT NULL THEN
            v_size := idempotency._raw_size(complete.headers);
            PERFORM idempotency._check_size('idempotency.complete', 'headers', v_size,
                                            'max_headers_bytes');
        END IF;
        PERFORM idempotency._check_response('idempotency.complete', complete.scope,
                                            complete.key, complete.lease_token,
                                            complete.status, complete.headers);
        IF complete.reference_time IS NOT NULL THEN
            v_now := idempotency._test_clock('idempotency.complete', complete.reference_time);
        END IF;
    END IF;
    v_completed := idempotency._complete_row(
        complete.scope, complete.key, complete.lease_token, NULL, complete.status,
        complete.headers, complete.body, NULL,
        CASE WHEN complete.body IS NULL THEN NULL ELSE 'application/json' END,
        coalesce(v_now, clock_timestamp()));
    IF v_completed IS NULL THEN
        -- No key in progress matched this token. The test above left out the form of the
        -- scope and the key and the token's NULL: claim never stores a bad name, and no row
        -- has a NULL token, so a bad one can only miss, and is reported now, with the error the
        -- branch above raises for it (its other arguments passed there), before the lease's.
        PERFORM idempotency._check_response('idempotency.complete', complete.scope,
                                            complete.key, complete.lease_token,
                                            complete.status, complete.headers);
        PERFORM idempotency._lease_error('idempotency.complete', complete.scope, complete.key,
                                         complete.lease_token);
    END IF;
    RETURN v_completed;
END;
$$;

COMMENT ON FUNCTION idempotency.complete(text, text, bigint, integer, jsonb, jsonb, timestamptz) IS
'Complete a key you hold with a JSON response (body may be NULL, e.g. for 204), in the same
transaction as the business write; returns completed_at. Raises IK001 (not the key''s current
token: roll back) or IK004 (already completed with this token).';
