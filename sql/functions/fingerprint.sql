-- sha256 of the canonical request. defaults are applied first (a shallow merge: a top-level
-- field the request omits takes its default, so omitting a field and sending its default give
-- the same fingerprint); then, when fields is given, only those top-level fields count, so
-- that a field which does not affect the outcome (a client timestamp, a trace id) cannot turn a
-- retry into a mismatch.
--
-- STABLE, not IMMUTABLE (as it was before 0.11.0), for the reason given in canonical_json.sql:
-- its size check reads settings.max_request_bytes. A request passed to claim(..., NULL,
-- fingerprint => fingerprint(request, defaults, fields)) is thus refused at the same size as
-- one passed as claim's request.
CREATE FUNCTION idempotency.fingerprint(
    request jsonb, defaults jsonb DEFAULT '{}', fields text[] DEFAULT NULL
)
RETURNS bytea
LANGUAGE plpgsql
STABLE
-- SECURITY DEFINER: it calls the internal _canonical_json, which application roles may not.
SECURITY DEFINER
PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_size integer;  -- _raw_size's, assigned before the PERFORM that uses it (see there)
    v_request jsonb := fingerprint.request;
BEGIN
    IF v_request IS NULL THEN
        PERFORM idempotency._invalid_argument('idempotency.fingerprint', 'request', 'IK010',
                                              'must not be NULL');
    END IF;
    -- Sizes before any work on them, uncompressed (see _check_size and _raw_size). fields
    -- has the request's limit too: it is matched against every key of the request.
    IF pg_column_size(v_request) > 65536 OR pg_column_compression(v_request) IS NOT NULL THEN
        v_size := idempotency._raw_size(v_request);
        PERFORM idempotency._check_size('idempotency.fingerprint', 'request', v_size,
                                        'max_request_bytes');
    END IF;
    IF pg_column_size(fingerprint.defaults) > 65536
       OR pg_column_compression(fingerprint.defaults) IS NOT NULL THEN
        v_size := idempotency._raw_size(fingerprint.defaults);
        PERFORM idempotency._check_size('idempotency.fingerprint', 'defaults', v_size,
                                        'max_request_bytes');
    END IF;
    IF pg_column_size(fingerprint.fields) > 65536
       OR pg_column_compression(fingerprint.fields) IS NOT NULL THEN
        -- (|| of an empty array returns the array it was given, decompressed.)
        v_size := pg_column_size(fingerprint.fields || '{}'::text[]);
        PERFORM idempotency._check_size('idempotency.fingerprint', 'fields', v_size,
                                        'max_request_bytes');
    END IF;
    IF coalesce(fingerprint.defaults, '{}') <> '{}' OR fingerprint.fields IS NOT NULL THEN
        IF jsonb_typeof(v_request) <> 'object' THEN
            PERFORM idempotency._invalid_argument(
                'idempotency.fingerprint', 'request', 'IK015',
                'must be a JSON object when defaults or fields are given',
                format('It is a JSON %s.', jsonb_typeof(v_request)));
        END IF;
        IF jsonb_typeof(fingerprint.defaults) <> 'object' THEN
            PERFORM idempotency._invalid_argument(
                'idempotency.fingerprint', 'defaults', 'IK015', 'must be a JSON object',
                format('It is a JSON %s.', jsonb_typeof(fingerprint.defaults)));
        END IF;
        IF array_ndims(fingerprint.fields) > 1 THEN
            -- (array_position would raise 0A000 on it.)
            PERFORM idempotency._invalid_argument(
                'idempotency.fingerprint', 'fields', 'IK015', 'must be a one-dimensional array',
                format('It has %s dimensions.', array_ndims(fingerprint.fields)));
        END IF;
        IF array_position(fingerprint.fields, NULL) IS NOT NULL THEN
            PERFORM idempotency._invalid_argument('idempotency.fingerprint', 'fields', 'IK010',
                                                  'must not contain NULL');
        END IF;
        v_request := coalesce(fingerprint.defaults, '{}') || v_request;
        IF fingerprint.fields IS NOT NULL THEN
            SELECT coalesce(jsonb_object_agg(m.key, m.value), '{}') INTO v_request
            FROM jsonb_each(v_request) AS m
            WHERE m.key = ANY(fingerprint.fields);
        END IF;
    END IF;
    RETURN sha256(convert_to(
        idempotency._canonical_json(v_request, 'idempotency.fingerprint', 'request', 1,
                                    false),
        'UTF8'));
END;
$$;

COMMENT ON FUNCTION idempotency.fingerprint(jsonb, jsonb, text[]) IS
'sha256 (32 bytes) of the canonical form of request, after applying defaults and keeping only
fields when given. Definition and test vectors: docs/fingerprint.md, tests/vectors/fingerprint.json.';
