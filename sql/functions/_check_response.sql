-- Says which argument is wrong among those that complete(), complete_bytes() and accept()
-- share, in the caller's name fn. Those functions test the same arguments in one inlined
-- expression first and call this only when it fails, so the common path never enters it.
CREATE FUNCTION idempotency._check_response(
    fn text,
    scope text,
    key text,
    lease_token bigint,
    status integer,
    headers jsonb
)
RETURNS void
LANGUAGE plpgsql
IMMUTABLE
PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM idempotency._check_name(_check_response.fn, 'scope', _check_response.scope);
    PERFORM idempotency._check_name(_check_response.fn, 'key', _check_response.key);
    IF _check_response.lease_token IS NULL THEN
        PERFORM idempotency._invalid_argument(_check_response.fn, 'lease_token', 'IK010',
                                              'must not be NULL');
    END IF;
    IF _check_response.status IS NULL THEN
        PERFORM idempotency._invalid_argument(_check_response.fn, 'status', 'IK010',
                                              'must not be NULL');
    ELSIF _check_response.status NOT BETWEEN 100 AND 599 THEN
        PERFORM idempotency._invalid_argument(_check_response.fn, 'status', 'IK014',
                                              'must be an HTTP status code (100 to 599)',
                                              format('It is %s.', _check_response.status));
    END IF;
    PERFORM idempotency._check_headers(_check_response.fn, 'headers', _check_response.headers);
END;
$$;

COMMENT ON FUNCTION idempotency._check_response(text, text, text, bigint, integer, jsonb) IS
'Internal: raises the documented error for the first invalid argument that complete(),
complete_bytes() and accept() share (scope, key, lease_token, status, headers).';
