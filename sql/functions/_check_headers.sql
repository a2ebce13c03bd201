-- Response headers are a JSON object of header name to string value (no control characters),
-- so every client can replay them without guessing how a number or a list is written.
CREATE FUNCTION idempotency._check_headers(fn text, argument text, value jsonb)
RETURNS void
LANGUAGE plpgsql
IMMUTABLE
PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_bad text;
BEGIN
    IF jsonb_typeof(_check_headers.value) <> 'object' THEN
        PERFORM idempotency._invalid_argument(
            _check_headers.fn, _check_headers.argument, 'IK015',
            'must be a JSON object of header names to string values',
            format('It is a JSON %s.', jsonb_typeof(_check_headers.value)));
    END IF;
    SELECT h.key INTO v_bad
    FROM jsonb_each(_check_headers.value) AS h
    WHERE jsonb_typeof(h.value) <> 'string' OR h.key = '' OR h.key ~ '[[:cntrl:][:space:]:]'
       -- A CR or LF in a value would let a replayed header inject header lines.
       OR h.value #>> '{}' ~ '[[:cntrl:]]'
    LIMIT 1;
    IF FOUND THEN
        PERFORM idempotency._invalid_argument(
            _check_headers.fn, _check_headers.argument, 'IK015',
            'must be a JSON object of header names to string values',
            format('Header %s has an invalid name, or a value that is not a string or holds '
                   'control characters.',
                   to_json(v_bad)));
    END IF;
END;
$$;

COMMENT ON FUNCTION idempotency._check_headers(text, text, jsonb) IS
'Internal: validate response headers (a JSON object of names to string values).';
