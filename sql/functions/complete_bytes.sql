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
    v_headers jsonb := coalesce(complete_bytes.headers, '{}');
    v_completed timestamptz;
BEGIN
    -- A body needs its content type; a content type is checked even without a body, since it
    -- is replayed as a header either way.
    IF (complete_bytes.body IS NOT NULL OR complete_bytes.content_type IS NOT NULL)
       AND NOT coalesce(idempotency._name_ok(complete_bytes.content_type), false) THEN
        PERFORM idempotency._check_name('idempotency.complete_bytes', 'content_type',
                                        complete_bytes.content_type);
    END IF;
    -- The other arguments as in complete(), sizes first.
    IF NOT coalesce(idempotency._name_ok(complete_bytes.scope)
                    AND idempotency._name_ok(complete_bytes.key)
                    AND complete_bytes.lease_token IS NOT NULL
                    AND complete_bytes.status BETWEEN 100 AND 599
                    AND (complete_bytes.body IS NULL
                         OR octet_length(complete_bytes.body) <= 65536)
                    AND pg_column_size(v_headers) <= 4096
                    AND idempotency._headers_ok(v_headers), false) THEN
        IF octet_length(complete_bytes.body) > 65536 THEN
            PERFORM idempotency._check_size('idempotency.complete_bytes', 'body',
                                            octet_length(complete_bytes.body),
                                            'max_response_bytes');
        END IF;
        IF pg_column_size(v_headers) > 4096 THEN
            PERFORM idempotency._check_size('idempotency.complete_bytes', 'headers',
                                            pg_column_size(v_headers), 'max_headers_bytes');
        END IF;
        PERFORM idempotency._check_response('idempotency.complete_bytes', complete_bytes.scope,
                                            complete_bytes.key, complete_bytes.lease_token,
                                            complete_bytes.status, v_headers);
    END IF;
    v_completed := idempotency._complete_row(
        complete_bytes.scope, complete_bytes.key, complete_bytes.lease_token, NULL,
        complete_bytes.status, v_headers, NULL, complete_bytes.body, complete_bytes.content_type,
        CASE WHEN complete_bytes.reference_time IS NULL THEN clock_timestamp()
             ELSE idempotency._test_clock('idempotency.complete_bytes',
                                          complete_bytes.reference_time) END);
    IF v_completed IS NULL THEN
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
