-- Refuses an argument larger than its limit in idempotency.settings (max_request_bytes,
-- max_response_bytes or max_headers_bytes) with IK018, before anything canonicalizes, hashes or
-- stores it: a 200 MB JSON response once took 42 s and 1.4 GB of one backend's memory, and
-- 300 MB failed with 54000 deep inside the engine.
--
-- The callers measure the value as the caller means it, uncompressed (_raw_size of a jsonb,
-- octet_length of a bytea: both read its header only unless it is compressed), and call this
-- only when the size is above the smallest limit the settings allow (65536 bytes for bodies,
-- 4096 for headers, the CHECKs on idempotency.settings): the settings row stays off the hot
-- path for every ordinary call.
--
-- canonical: size is of the canonical JSON built so far from the argument (_canonical_json
-- measures it as it grows, against max_request_bytes), and the message says so: a value within
-- the limit can still have a longer canonical text (an escaped control character is one byte
-- in jsonb and six in the text).
--
-- nesting: size is the sum of the sizes of the arrays and objects on the path to the one
-- _canonical_json is building, each holding a copy of what it encloses; the limit is 8 times
-- max_request_bytes, and the message says it is the nesting that repeats the value.
CREATE FUNCTION idempotency._check_size(
    fn text, argument text, size bigint, setting text, canonical boolean DEFAULT false,
    nesting boolean DEFAULT false
)
RETURNS void
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_limit integer;
    v_bound bigint;  -- the limit, times 8 with nesting
BEGIN
    SELECT CASE _check_size.setting
               WHEN 'max_request_bytes' THEN s.max_request_bytes
               WHEN 'max_response_bytes' THEN s.max_response_bytes
               WHEN 'max_headers_bytes' THEN s.max_headers_bytes
           END
    INTO v_limit
    FROM idempotency.settings AS s;
    IF v_limit IS NULL THEN
        -- No settings row yet (it is made by the first _premake() or maintain()): the
        -- defaults of sql/tables/settings.sql.
        v_limit := CASE _check_size.setting WHEN 'max_headers_bytes' THEN 16384
                                            ELSE 1048576 END;
    END IF;
    v_bound := CASE WHEN _check_size.nesting THEN 8::bigint * v_limit ELSE v_limit::bigint END;
    IF _check_size.size > v_bound THEN
        RAISE EXCEPTION USING
            MESSAGE = format('%s: argument "%s" is too large', _check_size.fn,
                             _check_size.argument),
            ERRCODE = 'IK018',
            COLUMN = _check_size.argument,
            DETAIL = format(CASE WHEN _check_size.nesting
                                 THEN 'It nests a large value deep: the arrays and objects '
                                      'enclosing it hold at least %s bytes of copies of it '
                                      'while it is canonicalized; the limit is 8 times '
                                      'settings.%s, %s bytes.'
                                 WHEN _check_size.canonical
                                 THEN 'Its canonical JSON (docs/fingerprint.md) is at least %s '
                                      'bytes; the limit (settings.%s) is %s bytes.'
                                 ELSE 'It is %s bytes; the limit (settings.%s) is %s bytes.'
                            END,
                            _check_size.size, _check_size.setting, v_bound),
            HINT = format('Nothing was written. Send a smaller value, or have the schema owner '
                          'raise settings.%s (docs/maintenance.md). See docs/errors.md.',
                          _check_size.setting);
    END IF;
END;
$$;

COMMENT ON FUNCTION idempotency._check_size(text, text, bigint, text, boolean, boolean) IS
'Internal: raise IK018 when size (bytes, uncompressed; with canonical, of the canonical JSON
built so far; with nesting, of the arrays and objects enclosing the one being canonicalized,
against 8 times the limit) exceeds the limit in idempotency.settings named by setting
(max_request_bytes, max_response_bytes or max_headers_bytes).';
