-- The canonical text of a JSON value, the input of fingerprint(). Defined exactly in
-- docs/fingerprint.md so that a client in any language can compute the same bytes:
--   * objects: members sorted by key in code point (UTF-8 byte) order, "key":value, joined by ",";
--   * arrays: elements in order, joined by ",";
--   * numbers: plain decimal, no exponent, no "+", no trailing fractional zeros, no trailing ".",
--     so 10, 10.0 and 1e1 all read 10 (jsonb keeps the exact decimal, so nothing is rounded),
--     when 1e-7 <= |value| < 1e21 or value = 0; any other number by its significant digits and
--     exponent (1e21, -1.5e-30: _canonical_number), so that no number is written longer than
--     its digits in the JSON text (numeric's text output expanded 1e131071 to 131,072 digits);
--   * strings: JSON escapes for '"', '\' and U+0000..U+001F (\b \f \n \r \t, else \u00xx in
--     lower-case hex), every other character as itself in UTF-8;
--   * true, false, null as such; no whitespace anywhere.
-- Scalars are formatted in place rather than by a recursive call, which is what keeps a flat
-- request body to a single call; the plain-range test of a number is inline for the same
-- reason, and only numbers outside it cost a call. Nesting deeper than 128 arrays and objects
-- is refused with IK014 naming the caller's argument (without a limit, about 520 levels ran
-- out of stack: 54001); the Python twin (pg_idempotency.fingerprint) refuses the same.
--
-- The text is measured as it is built, after each array and object, against
-- settings.max_request_bytes (IK018, _check_size): a value within the limit as the
-- server holds it can still have a longer canonical text (an escaped control character is one
-- byte in jsonb and six in the text), and a size is checked on what is built, not after.
-- octet_length of a text in memory reads its header; the settings row is read only above
-- 64 KiB. So STABLE (it was IMMUTABLE before 0.12.0): whether a value is refused depends on a
-- table.
--
-- Nesting repeats a value in memory: jsonb_each and jsonb_array_elements copy each member
-- into a datum of its own, and each level's query stays open while the levels below it are
-- built, so every array and object on the path to the one being built holds a copy of what it
-- encloses (128 arrays around 880 KB, within every other limit, took about 380 MB of one
-- backend). enclosing is the sum of the sizes (pg_column_size) of the arrays and objects
-- enclosing this one; with this one's, it is refused with IK018 (_check_size, nesting => true)
-- above 8 times settings.max_request_bytes, which bounds the copies held to a few times that.
-- A body of the full limit still nests 7 levels below its top (wrappers included) before it
-- reaches it; the Python twin copies nothing and has no such bound. The sum is compared with
-- 8 times the smallest limit allowed first, so the settings row stays off the hot path.
--
-- legacy => true writes every number in plain decimal, as 0.11.0 and earlier did: the form
-- whose sha256 keys claimed before 0.12.0 hold, which claim() recognises (_legacy_fingerprint
-- calls it only after computing, without expanding anything, that the text fits the limit).
CREATE FUNCTION idempotency._canonical_json(
    value jsonb, fn text, argument text, depth integer, legacy boolean,
    enclosing bigint DEFAULT 0
)
RETURNS text
LANGUAGE plpgsql
STABLE
STRICT
PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_text text;
    v_held bigint;  -- the copies held on the path to this value, this one's included
BEGIN
    IF _canonical_json.depth > 128 THEN
        PERFORM idempotency._invalid_argument(
            _canonical_json.fn, _canonical_json.argument, 'IK014',
            'must not nest arrays and objects more than 128 deep');
    END IF;
    IF _canonical_json.depth > 1 THEN
        -- (At the top the callers have measured the value, uncompressed, against the limit.)
        v_held := _canonical_json.enclosing + pg_column_size(_canonical_json.value);
        IF v_held > 8 * 65536 THEN
            PERFORM idempotency._check_size(_canonical_json.fn, _canonical_json.argument,
                                            v_held, 'max_request_bytes', nesting => true);
        END IF;
    ELSE
        v_held := pg_column_size(_canonical_json.value)::bigint;
    END IF;
    CASE jsonb_typeof(_canonical_json.value)
        WHEN 'object' THEN
            v_text := '{' || coalesce((
                SELECT string_agg(
                    to_json(m.key)::text || ':' || CASE jsonb_typeof(m.value)
                        WHEN 'number' THEN CASE
                            WHEN _canonical_json.legacy
                                 OR (abs(m.value::numeric) < 1e21
                                     AND (abs(m.value::numeric) >= 1e-7
                                          OR m.value::numeric = 0))
                                THEN trim_scale(m.value::numeric)::text
                            ELSE idempotency._canonical_number(m.value::numeric)
                        END
                        WHEN 'object' THEN idempotency._canonical_json(
                            m.value, _canonical_json.fn, _canonical_json.argument,
                            _canonical_json.depth + 1, _canonical_json.legacy, v_held)
                        WHEN 'array' THEN idempotency._canonical_json(
                            m.value, _canonical_json.fn, _canonical_json.argument,
                            _canonical_json.depth + 1, _canonical_json.legacy, v_held)
                        ELSE m.value::text
                    END,
                    ',' ORDER BY m.key COLLATE "C")
                FROM jsonb_each(_canonical_json.value) AS m
            ), '') || '}';
        WHEN 'array' THEN
            v_text := '[' || coalesce((
                SELECT string_agg(
                    CASE jsonb_typeof(e.value)
                        WHEN 'number' THEN CASE
                            WHEN _canonical_json.legacy
                                 OR (abs(e.value::numeric) < 1e21
                                     AND (abs(e.value::numeric) >= 1e-7
                                          OR e.value::numeric = 0))
                                THEN trim_scale(e.value::numeric)::text
                            ELSE idempotency._canonical_number(e.value::numeric)
                        END
                        WHEN 'object' THEN idempotency._canonical_json(
                            e.value, _canonical_json.fn, _canonical_json.argument,
                            _canonical_json.depth + 1, _canonical_json.legacy, v_held)
                        WHEN 'array' THEN idempotency._canonical_json(
                            e.value, _canonical_json.fn, _canonical_json.argument,
                            _canonical_json.depth + 1, _canonical_json.legacy, v_held)
                        ELSE e.value::text
                    END,
                    ',' ORDER BY e.ordinality)
                FROM jsonb_array_elements(_canonical_json.value) WITH ORDINALITY AS e
            ), '') || ']';
        WHEN 'number' THEN
            IF _canonical_json.legacy THEN
                RETURN trim_scale(_canonical_json.value::numeric)::text;
            END IF;
            RETURN idempotency._canonical_number(_canonical_json.value::numeric);
        ELSE
            -- string, boolean, null: jsonb's text form is already the canonical one.
            RETURN _canonical_json.value::text;
    END CASE;
    IF octet_length(v_text) > 65536 THEN
        PERFORM idempotency._check_size(_canonical_json.fn, _canonical_json.argument,
                                        octet_length(v_text), 'max_request_bytes', true);
    END IF;
    RETURN v_text;
END;
$$;

COMMENT ON FUNCTION idempotency._canonical_json(jsonb, text, text, integer, boolean, bigint) IS
'Internal: canonical_json() at nesting depth, for fn''s argument (which an error names); with
legacy, numbers in plain decimal as before 0.12.0; enclosing, the summed sizes of the arrays and
objects around value (IK018 above 8 times settings.max_request_bytes).';
