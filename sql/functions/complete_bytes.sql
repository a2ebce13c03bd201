-- complete() for responses that are not JSON (a PDF, a CSV, an XML body): the bytes and their
-- content type are replayed as they were. The same fenced route as complete() (see there).
CREATE FUNCTION idempotency.complete_bytes(
    scope text,
    key text,
    lease_token bigint,
    status integer,
    body bytea,
    content_type text,
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
    -- operand would make the whole test NULL. The form of the scope and the key and the
    -- token's NULL are left to the miss below, as in complete(). headers NULL takes the
    -- branch, which makes it '{}'.
    IF NOT coalesce(complete_bytes.reference_time IS NULL
                    AND complete_bytes.scope IS NOT NULL
                    AND complete_bytes.status BETWEEN 100 AND 599
                    AND (complete_bytes.body IS NULL AND complete_bytes.content_type IS NULL
                         OR idempotency._name_ok(complete_bytes.content_type))
                    AND (complete_bytes.body IS NULL
                         OR octet_length(complete_bytes.body) <= 65536)
                    AND pg_column_size(complete_bytes.headers) <= 4096
                    AND pg_column_compression(complete_bytes.headers) IS NULL
                    AND idempotency._headers_ok(complete_bytes.headers), false) THEN
        complete_bytes.headers := coalesce(complete_bytes.headers, '{}');
        -- A body needs its content type; a content type is checked even without a body,
        -- since it is replayed as a header either way.
        IF complete_bytes.body IS NOT NULL OR complete_bytes.content_type IS NOT NULL THEN
            PERFORM idempotency._check_name('idempotency.complete_bytes', 'content_type',
                                            complete_bytes.content_type);
        END IF;
        -- The other arguments as in complete(), sizes first (octet_length of a bytea is its
        -- uncompressed size, read from its header).
        IF octet_length(complete_bytes.body) > 65536 THEN
            PERFORM idempotency._check_size('idempotency.complete_bytes', 'body',
                                            octet_length(complete_bytes.body),
                                            'max_response_bytes');
        END IF;
        IF pg_column_size(complete_bytes.headers) > 4096
           OR pg_column_compression(complete_bytes.headers) IS NOT NULL THEN
            v_size := idempotency._raw_size(complete_bytes.headers);
            PERFORM idempotency._check_size('idempotency.complete_bytes', 'headers', v_size,
                                            'max_headers_bytes');
        END IF;
        PERFORM idempotency._check_response('idempotency.complete_bytes', complete_bytes.scope,
                                            complete_bytes.key, complete_bytes.lease_token,
                                            complete_bytes.status, complete_bytes.headers);
        IF complete_bytes.reference_time IS NOT NULL THEN
            v_now := idempotency._test_clock('idempotency.complete_bytes',
                                             complete_bytes.reference_time);
        END IF;
    END IF;
    v_completed := idempotency._complete_row(
        complete_bytes.scope, complete_bytes.key, complete_bytes.lease_token, NULL,
        complete_bytes.status, complete_bytes.headers, NULL, complete_bytes.body,
        complete_bytes.content_type, coalesce(v_now, clock_timestamp()));
    IF v_completed IS NULL THEN
        -- No key in progress matched: the scope, key and token are checked now, as in
        -- complete() (see there), and only then the lease.
        PERFORM idempotency._check_response('idempotency.complete_bytes', complete_bytes.scope,
                                            complete_bytes.key, complete_bytes.lease_token,
                                            complete_bytes.status, complete_bytes.headers);
        PERFORM idempotency._lease_error('idempotency.complete_bytes', complete_bytes.scope,
                                         complete_bytes.key, complete_bytes.lease_token);
    END IF;
    RETURN v_completed;
END;
$$;

COMMENT ON FUNCTION idempotency.complete_bytes(
    text, text, bigint, integer, bytea, text, jsonb, timestamptz
) IS
'Complete a key you hold with a non-JSON response body and its content type, in the same
transaction as the business write; returns completed_at. Raises IK001 or IK004.';
