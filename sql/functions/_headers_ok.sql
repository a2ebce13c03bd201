-- The happy-path test of _check_headers as one jsonpath expression, inlinable for the same
-- reason as _name_ok (and likewise without SET search_path, with qualified functions).
CREATE FUNCTION idempotency._headers_ok(value jsonb)
RETURNS boolean
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
RETURN (
    value IS NOT NULL
    AND pg_catalog.jsonb_typeof(value) OPERATOR(pg_catalog.=) 'object'
    AND NOT pg_catalog.jsonb_path_exists(
        value,
        '$.keyvalue() ? (@.value.type() != "string" || @.key like_regex "^$|[[:cntrl:][:space:]:]"'
        ' || @.value like_regex "[[:cntrl:]]")'
    )
);

COMMENT ON FUNCTION idempotency._headers_ok(jsonb) IS
'Internal: true when value passes idempotency._check_headers (inlined into callers).';
