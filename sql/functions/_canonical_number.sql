-- The canonical text of a number outside the plain range of docs/fingerprint.md, written
-- without expanding it. numeric's text output writes every digit of the plain decimal:
-- 1e131071 (8 bytes of JSON) became 131,072 characters, and a request of such numbers
-- canonicalized to gigabytes within the size limits. So a number whose exponent E (of its
-- first significant digit) is below -7 or above 20 is written as its significant digits and E:
-- sign, first digit, "." and the other digits if any (no trailing zeros), "e", E in decimal
-- ("-" if negative, no "+"): 1e21 -> 1e21, 1500e18 -> 1.5e21, -123e-30 -> -1.23e-28. Every
-- digit of that text was spelled in the JSON text (a literal spells every digit from its
-- first significant one to its last), so it is never much longer than the input.
--
-- Only numeric arithmetic, which keeps every digit exactly and stores a number by its
-- significant digits (1e131071 is one base-10000 digit and a weight): the value is shifted by
-- powers of ten until it has a fractional part, then its digits read as an integer. A shift
-- by 10^-16383 at a time, the smallest power of ten numeric can hold (a product's scale is the
-- sum of its factors' scales, at most 16383): at most nine shifts, for 131072-digit integers.
-- Callers test the plain range themselves (the common case stays one inline expression) and
-- call this for the rest; it answers the plain form too, for any caller.
CREATE FUNCTION idempotency._canonical_number(value numeric)
RETURNS text
LANGUAGE plpgsql
IMMUTABLE
STRICT
PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_abs numeric := trim_scale(abs(_canonical_number.value));
    v_shift integer := 0;
    v_digits text;
BEGIN
    IF v_abs < 1e21 AND (v_abs >= 1e-7 OR v_abs = 0) THEN
        RETURN trim_scale(_canonical_number.value)::text;
    END IF;
    -- An integer (scale 0 after trim_scale): shift it right until a fractional part appears,
    -- v_abs = |value| * 10^-v_shift throughout.
    WHILE scale(v_abs) = 0 LOOP
        v_abs := trim_scale(v_abs * 1e-16383);
        v_shift := v_shift + 16383;
    END LOOP;
    -- Its significant digits as an integer: scale(v_abs) places to the left (a power of ten
    -- of scale 0 keeps the product's scale), the last one non-zero.
    v_digits := trim_scale(v_abs * ('1e' || scale(v_abs))::numeric)::text;
    RETURN CASE WHEN _canonical_number.value < 0 THEN '-' ELSE '' END
        || left(v_digits, 1)
        || CASE WHEN length(v_digits) > 1 THEN '.' || substr(v_digits, 2) ELSE '' END
        || 'e' || (length(v_digits) - 1 - scale(v_abs) + v_shift)::text;
END;
$$;

COMMENT ON FUNCTION idempotency._canonical_number(numeric) IS
'Internal: the canonical text of a number (docs/fingerprint.md): plain decimal when 1e-7 <=
|value| < 1e21 or value = 0, else significant digits and exponent (1.5e21), never expanded.';
