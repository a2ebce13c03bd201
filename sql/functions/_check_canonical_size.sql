-- Refuses a canonical text that has grown past settings.max_request_bytes, with IK018 naming
-- the argument it was built from. _canonical_json calls it as the text grows (after each array
-- and object), so an argument within the size limit as the server holds it cannot build a
-- larger text than the limit (plus the one level being built) before it is refused: the
-- canonical text is what gets hashed, and what a client in another language builds.
--
-- Called only above 65536 bytes (the smallest limit the settings allow), as _check_size is:
-- the settings row stays off the path of every ordinary request.
CREATE FUNCTION idempotency._check_canonical_size(fn text, argument text, size integer)
RETURNS void
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_limit integer;
BEGIN
    SELECT s.max_request_bytes INTO v_limit FROM idempotency.settings AS s;
    -- No settings row yet: the default of sql/tables/settings.sql.
    v_limit := coalesce(v_limit, 1048576);
    IF _check_canonical_size.size > v_limit THEN
        RAISE EXCEPTION USING
            MESSAGE = format('%s: argument "%s" is too large', _check_canonical_size.fn,
                             _check_canonical_size.argument),
            ERRCODE = 'IK018',
            COLUMN = _check_canonical_size.argument,
            DETAIL = format('Its canonical JSON (docs/fingerprint.md) is at least %s bytes; the '
                            'limit (settings.max_request_bytes) is %s bytes.',
                            _check_canonical_size.size, v_limit),
            HINT = 'Nothing was written. Send a smaller value, or have the schema owner raise '
                   || 'settings.max_request_bytes (docs/maintenance.md). See docs/errors.md.';
    END IF;
END;
$$;

COMMENT ON FUNCTION idempotency._check_canonical_size(text, text, integer) IS
'Internal: raise IK018 when size (bytes of canonical JSON built so far from fn''s argument)
exceeds settings.max_request_bytes.';
