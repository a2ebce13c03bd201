-- The canonical text of a JSON value (docs/fingerprint.md); the work is done by
-- idempotency._canonical_json, which says which argument of which function was refused.
-- PL/pgSQL (a SQL function before 0.11.0) for the size check before that work (_check_size).
-- STABLE, not IMMUTABLE (as it was before 0.11.0): above 64 KiB the check reads
-- settings.max_request_bytes, so whether a value is refused depends on a table, and the planner
-- may fold an IMMUTABLE call once and keep its answer (a cached plan, an index expression that
-- a later REINDEX or restore evaluates again under another limit). The limit stays the
-- setting's, the same as claim()'s for the request it fingerprints. Its cost: none measured
-- (backend CPU per call, 43.5 us either way, docs/fingerprint.md); claim() does not call it.
CREATE FUNCTION idempotency.canonical_json(value jsonb)
RETURNS text
LANGUAGE plpgsql
STABLE
STRICT
-- SECURITY DEFINER: it calls the internal _canonical_json, which application roles may not.
SECURITY DEFINER
PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_size integer;  -- _raw_size's, assigned before the PERFORM that uses it (see there)
BEGIN
    IF pg_column_size(canonical_json.value) > 65536
       OR pg_column_compression(canonical_json.value) IS NOT NULL THEN
        v_size := idempotency._raw_size(canonical_json.value);
        PERFORM idempotency._check_size('idempotency.canonical_json', 'value', v_size,
                                        'max_request_bytes');
    END IF;
    RETURN idempotency._canonical_json(canonical_json.value, 'idempotency.canonical_json',
                                       'value', 1, false);
END;
$$;

COMMENT ON FUNCTION idempotency.canonical_json(jsonb) IS
'Canonical text of a JSON value (sorted keys, numbers in plain decimal or, outside 1e-7 <= |n| <
1e21, as digits and exponent, minimal escapes, no whitespace), as defined in
docs/fingerprint.md. Refuses a value or a canonical text larger than settings.max_request_bytes
(IK018).';
