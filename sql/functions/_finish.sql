-- The fenced write shared by complete() and complete_bytes(). The UPDATE matches only while the
-- caller's token is still the key's token; otherwise _lease_error raises, and the caller's
-- business writes in the same transaction roll back with it. A stale worker can never commit a
-- completion.
CREATE FUNCTION idempotency._finish(
    fn text,
    scope text,
    key text,
    lease_token bigint,
    status integer,
    headers jsonb,
    body jsonb,
    body_bytes bytea,
    content_type text,
    reference_time timestamptz
)
RETURNS timestamptz
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
-- A generic plan prunes the partitions of keys at executor startup; see docs/design.md.
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_now timestamptz := CASE WHEN _finish.reference_time IS NULL THEN clock_timestamp()
        ELSE idempotency._test_clock(_finish.fn, _finish.reference_time) END;
    v_created_at timestamptz;
    v_completed timestamptz;
BEGIN
    -- One inlined test for the common case; the checks below it say what is wrong.
    -- coalesce: one NULL operand would make the whole test NULL, and IF NOT NULL skips.
    IF NOT coalesce(idempotency._name_ok(_finish.scope) AND idempotency._name_ok(_finish.key)
                    AND _finish.lease_token IS NOT NULL AND _finish.status BETWEEN 100 AND 599
                    AND idempotency._headers_ok(_finish.headers), false) THEN
        PERFORM idempotency._check_response(_finish.fn, _finish.scope, _finish.key,
                                            _finish.lease_token, _finish.status,
                                            _finish.headers);
    END IF;

    -- The key's one partition, from the directory (see claim).
    SELECT d.created_at INTO v_created_at
    FROM idempotency.key_directory AS d
    WHERE d.scope = _finish.scope AND d.key_hash = sha256(convert_to(_finish.key, 'UTF8'));

    -- The fenced UPDATE, on the one partition created_at names (see _make_routes).
    v_completed := idempotency._complete_row(
        _finish.scope, _finish.key, _finish.lease_token, v_created_at, _finish.status,
        _finish.headers, _finish.body, _finish.body_bytes, _finish.content_type, v_now);
    IF v_completed IS NULL THEN
        PERFORM idempotency._lease_error(_finish.fn, _finish.scope, _finish.key,
                                         _finish.lease_token);
    END IF;
    RETURN v_completed;
END;
$$;

COMMENT ON FUNCTION idempotency._finish(
    text, text, text, bigint, integer, jsonb, jsonb, bytea, text, timestamptz
) IS
'Internal: the fenced completion shared by complete() and complete_bytes().';
