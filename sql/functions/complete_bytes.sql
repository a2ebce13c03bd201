-- complete() for responses that are not JSON (a PDF, a CSV, an XML body): the bytes and their
-- content type are replayed as they were.
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
BEGIN
    -- A body needs its content type; a content type is checked even without a body, since it
    -- is replayed as a header either way. The inlined test first: the PERFORM of _check_name
    -- cost 14 µs of complete_bytes' 170 (pg_stat_statements, track = all).
    IF (complete_bytes.body IS NOT NULL OR complete_bytes.content_type IS NOT NULL)
       AND NOT coalesce(idempotency._name_ok(complete_bytes.content_type), false) THEN
        PERFORM idempotency._check_name('idempotency.complete_bytes', 'content_type',
                                        complete_bytes.content_type);
    END IF;
    RETURN idempotency._finish(
        'idempotency.complete_bytes', complete_bytes.scope, complete_bytes.key,
        complete_bytes.lease_token, complete_bytes.status,
        coalesce(complete_bytes.headers, '{}'), NULL, complete_bytes.body,
        complete_bytes.content_type, complete_bytes.reference_time);
END;
$$;

COMMENT ON FUNCTION idempotency.complete_bytes(
    text, text, bigint, integer, bytea, text, jsonb, timestamptz
) IS
'Complete a key you hold with a non-JSON response body and its content type, in the same
transaction as the business write; returns completed_at. Raises IK001 or IK004.';
