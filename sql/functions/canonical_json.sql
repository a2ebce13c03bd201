-- The canonical text of a JSON value (docs/fingerprint.md); the work is done by
-- idempotency._canonical_json, which says which argument of which function was refused.
CREATE FUNCTION idempotency.canonical_json(value jsonb)
RETURNS text
LANGUAGE sql
IMMUTABLE
STRICT
-- SECURITY DEFINER: it calls the internal _canonical_json, which application roles may not.
SECURITY DEFINER
PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT idempotency._canonical_json(value, 'idempotency.canonical_json', 'value', 1);
$$;

COMMENT ON FUNCTION idempotency.canonical_json(jsonb) IS
'Canonical text of a JSON value (sorted keys, plain decimal numbers, minimal escapes, no
whitespace), as defined in docs/fingerprint.md.';
