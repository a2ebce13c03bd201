-- The canonical text of a JSON value, the input of fingerprint() and derive_key(). Defined
-- exactly in docs/fingerprint.md so that a client in any language can compute the same bytes:
--   * objects: members sorted by key in code point (UTF-8 byte) order, "key":value, joined by ",";
--   * arrays: elements in order, joined by ",";
--   * numbers: plain decimal, no exponent, no "+", no trailing fractional zeros, no trailing ".",
--     so 10, 10.0 and 1e1 all read 10 (jsonb keeps the exact decimal, so nothing is rounded);
--   * strings: JSON escapes for '"', '\' and U+0000..U+001F (\b \f \n \r \t, else \u00xx in
--     lower-case hex), every other character as itself in UTF-8;
--   * true, false, null as such; no whitespace anywhere.
-- Scalars are formatted in place rather than by a recursive call, which is what keeps a flat
-- request body to a single call. Nesting deeper than 128 arrays and objects is refused with
-- IK014 naming the caller's argument (without a limit, about 520 levels ran out of stack:
-- 54001); the Python twin (pg_idempotency.fingerprint) refuses the same.
CREATE FUNCTION idempotency._canonical_json(
    value jsonb, fn text, argument text, depth integer
)
RETURNS text
LANGUAGE plpgsql
IMMUTABLE
STRICT
PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF _canonical_json.depth > 128 THEN
        PERFORM idempotency._invalid_argument(
            _canonical_json.fn, _canonical_json.argument, 'IK014',
            'must not nest arrays and objects more than 128 deep');
    END IF;
    CASE jsonb_typeof(_canonical_json.value)
        WHEN 'object' THEN
            RETURN '{' || coalesce((
                SELECT string_agg(
                    to_json(m.key)::text || ':' || CASE jsonb_typeof(m.value)
                        WHEN 'number' THEN trim_scale(m.value::numeric)::text
                        WHEN 'object' THEN idempotency._canonical_json(
                            m.value, _canonical_json.fn, _canonical_json.argument,
                            _canonical_json.depth + 1)
                        WHEN 'array' THEN idempotency._canonical_json(
                            m.value, _canonical_json.fn, _canonical_json.argument,
                            _canonical_json.depth + 1)
                        ELSE m.value::text
                    END,
                    ',' ORDER BY m.key COLLATE "C")
                FROM jsonb_each(_canonical_json.value) AS m
            ), '') || '}';
        WHEN 'array' THEN
            RETURN '[' || coalesce((
                SELECT string_agg(
                    CASE jsonb_typeof(e.value)
                        WHEN 'number' THEN trim_scale(e.value::numeric)::text
                        WHEN 'object' THEN idempotency._canonical_json(
                            e.value, _canonical_json.fn, _canonical_json.argument,
                            _canonical_json.depth + 1)
                        WHEN 'array' THEN idempotency._canonical_json(
                            e.value, _canonical_json.fn, _canonical_json.argument,
                            _canonical_json.depth + 1)
                        ELSE e.value::text
                    END,
                    ',' ORDER BY e.ordinality)
                FROM jsonb_array_elements(_canonical_json.value) WITH ORDINALITY AS e
            ), '') || ']';
        WHEN 'number' THEN
            RETURN trim_scale(_canonical_json.value::numeric)::text;
        ELSE
            -- string, boolean, null: jsonb's text form is already the canonical one.
            RETURN _canonical_json.value::text;
    END CASE;
END;
$$;

COMMENT ON FUNCTION idempotency._canonical_json(jsonb, text, text, integer) IS
'Internal: canonical_json() at nesting depth, for fn''s argument (which an error names).';
