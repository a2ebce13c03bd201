-- Raises the error for a bad argument. One place decides the shape every client sees: the
-- message names the function and the argument, COLUMN carries the bare argument name (psycopg:
-- e.diag.column_name, JDBC: getServerErrorMessage().getColumn()), and the SQLSTATE is one of
-- the documented IK01x codes (docs/errors.md).
CREATE FUNCTION idempotency._invalid_argument(
    fn text, argument text, errcode text, problem text, detail text DEFAULT NULL
)
RETURNS void
LANGUAGE plpgsql
-- VOLATILE, not IMMUTABLE: it always raises, and the planner would run an immutable call with
-- constant arguments while planning the caller's statement, raising before any check.
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_message text := format('%s: argument "%s" %s', _invalid_argument.fn,
                             _invalid_argument.argument, _invalid_argument.problem);
    v_hint text := 'Nothing was written. See docs/errors.md for this SQLSTATE.';
BEGIN
    -- RAISE refuses a NULL option, so an absent detail needs its own statement.
    IF _invalid_argument.detail IS NULL THEN
        RAISE EXCEPTION USING MESSAGE = v_message, ERRCODE = _invalid_argument.errcode,
            COLUMN = _invalid_argument.argument, HINT = v_hint;
    END IF;
    RAISE EXCEPTION USING MESSAGE = v_message, ERRCODE = _invalid_argument.errcode,
        COLUMN = _invalid_argument.argument, DETAIL = _invalid_argument.detail, HINT = v_hint;
END;
$$;

COMMENT ON FUNCTION idempotency._invalid_argument(text, text, text, text, text) IS
'Internal: raise the documented error for an invalid argument of fn.';
