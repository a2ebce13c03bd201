-- The fingerprint 0.11.0 and earlier gave a request (docs/fingerprint.md, "Before 0.12.0"), or
-- NULL when it is the same as today's or too large to build. Until 0.12.0 every number was
-- written in plain decimal, so a request holding a number outside the plain range (|value| >=
-- 1e21, or below 1e-7 and not 0) had another canonical text and another sha256; a key claimed
-- with it before the upgrade holds that one. claim() calls this only when a key's fingerprint
-- differs from the request's, so a retry of such a key still matches after the upgrade.
--
-- Expansion is what the fix took away, so it is measured before it is done: the size of the
-- old text is today's plus, for each number outside the plain range, its plain decimal's
-- length less its exponent form's, computed from the exponent and the digits. Over
-- settings.max_request_bytes the old text is not built (NULL: the key answers mismatch, never
-- replay); within it, _canonical_json builds it with legacy => true.
CREATE FUNCTION idempotency._legacy_fingerprint(request jsonb, fn text, argument text)
RETURNS bytea
LANGUAGE plpgsql
STABLE
STRICT
PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_extra numeric;
    v_limit integer;
BEGIN
    -- Every number at any depth outside the plain range (the 128-level limit held for today's
    -- text before this is called). t is its exponent form: sign, digits, "e", exponent.
    SELECT sum(
        CASE WHEN x.exponent >= 0
            -- digits before the point, then the fractional ones if any
            THEN x.exponent + 1 + CASE WHEN x.digits - 1 > x.exponent
                                      THEN x.digits - x.exponent ELSE 0 END
            -- "0.", the zeros after the point, the digits
            ELSE 1 - x.exponent + x.digits
        END - (octet_length(x.t) - x.negative))
    INTO v_extra
    FROM (
        SELECT
            n.t,
            CASE WHEN left(n.t, 1) = '-' THEN 1 ELSE 0 END AS negative,
            split_part(n.t, 'e', 2)::bigint AS exponent,
            length(translate(split_part(n.t, 'e', 1), '-.', '')) AS digits
        FROM (
            SELECT idempotency._canonical_number(v::numeric) AS t
            FROM jsonb_path_query(
                _legacy_fingerprint.request,
                ('strict $.** ? (@.type() == "number" && (@ >= 1e21 || @ <= -1e21 '
                 || '|| (@ < 1e-7 && @ > -1e-7 && @ != 0)))')::jsonpath) AS v
        ) AS n
    ) AS x;
    IF v_extra IS NULL THEN
        RETURN NULL;  -- no such number: the old text is today's
    END IF;
    SELECT s.max_request_bytes INTO v_limit FROM idempotency.settings AS s;
    IF octet_length(idempotency._canonical_json(
           _legacy_fingerprint.request, _legacy_fingerprint.fn, _legacy_fingerprint.argument,
           1, false)) + v_extra > coalesce(v_limit, 1048576) THEN
        RETURN NULL;
    END IF;
    RETURN sha256(convert_to(idempotency._canonical_json(
        _legacy_fingerprint.request, _legacy_fingerprint.fn, _legacy_fingerprint.argument, 1,
        true), 'UTF8'));
END;
$$;

COMMENT ON FUNCTION idempotency._legacy_fingerprint(jsonb, text, text) IS
'Internal: sha256 of request''s canonical text as 0.11.0 wrote it (every number in plain
decimal), or NULL when that text is today''s or larger than settings.max_request_bytes.';
