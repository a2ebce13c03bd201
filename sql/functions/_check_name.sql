-- Scopes, keys, consumers, message ids, steps and recovery points share one rule set. Control
-- characters are refused because these values end up in logs, HTTP headers and other systems'
-- keys, where they break or forge lines. (NUL cannot reach here: PostgreSQL text cannot hold it,
-- and the server rejects it on input with SQLSTATE 22021.)
CREATE FUNCTION idempotency._check_name(fn text, argument text, value text)
RETURNS void
LANGUAGE plpgsql
IMMUTABLE
PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF _check_name.value IS NULL THEN
        PERFORM idempotency._invalid_argument(_check_name.fn, _check_name.argument, 'IK010',
                                              'must not be NULL');
    ELSIF _check_name.value = '' THEN
        PERFORM idempotency._invalid_argument(_check_name.fn, _check_name.argument, 'IK011',
                                              'must not be empty');
    ELSIF length(_check_name.value) > 255 THEN
        PERFORM idempotency._invalid_argument(
            _check_name.fn, _check_name.argument, 'IK012',
            'must be at most 255 characters long',
            format('It is %s characters long.', length(_check_name.value)));
    ELSIF _check_name.value ~ '[[:cntrl:]]' THEN
        PERFORM idempotency._invalid_argument(
            _check_name.fn, _check_name.argument, 'IK013',
            'must not contain control characters',
            format('Found %s at character %s.',
                   to_json(substring(_check_name.value FROM '[[:cntrl:]]')),
                   strpos(_check_name.value, substring(_check_name.value FROM '[[:cntrl:]]'))));
    END IF;
END;
$$;

COMMENT ON FUNCTION idempotency._check_name(text, text, text) IS
'Internal: validate a scope, key, consumer, message id, step or recovery point (not NULL, not
empty, at most 255 characters, no control characters).';
