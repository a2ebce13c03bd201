-- The canonical text of a JSON value (docs/fingerprint.md); the work is done by
-- idempotency._canonical_json, which says which argument of which function was refused.
-- PL/pgSQL (a SQL function before 0.11.0) for the size check before that work (_check_size).
CREATE FUNCTION idempotency.canonical_json(value jsonb)
RETURNS text
LANGUAGE plpgsql
IMMUTABLE
STRICT
-- SECURITY DEFINER: it calls the internal _canonical_json, which application roles may not.
SECURITY DEFINER
PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF pg_column_size(canonical_json.value) > 65536 THEN
        PERFORM idempotency._check_size('idempotency.canonical_json', 'value',
                                        pg_column_size(canonical_json.value),
                                        'max_request_bytes');
    END IF;
    RETURN idempotency._canonical_json(canonical_json.value, 'idempotency.canonical_json',
                                       'value', 1);
END;
$$;

COMMENT ON FUNCTION idempotency.canonical_json(jsonb) IS
'Canonical text of a JSON value (sorted keys, plain decimal numbers, minimal escapes, no
whitespace), as defined in docs/fingerprint.md. Refuses a value larger than
settings.max_request_bytes (IK018).';
