-- The engine's clock is clock_timestamp(). The reference_time argument of the functions that
-- take one replaces it, so that tests (and the conformance scenarios' virtual clock) can expire
-- leases without sleeping. It is checked here, and only when it is given (the functions call
-- this only for a non-NULL reference_time, so the hot path pays nothing):
--   - only a member of the role that owns schema idempotency (or a superuser) may pass it. An
--     application role that could move the clock could stretch or cut leases at will. The
--     invoker is read from the "role" setting (what SET ROLE chose) or else session_user,
--     because inside a SECURITY DEFINER function current_user is the owner;
--   - it must be a finite time between 1970 and 9999, so that no lease arithmetic overflows
--     (22008) and no lease is infinite.
-- No lookup depends on it: which rows a call finds is decided by idempotency.key_directory,
-- never by a time bound (see docs/design.md).
CREATE FUNCTION idempotency._test_clock(fn text, reference_time timestamptz)
RETURNS timestamptz
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_invoker text := current_setting('role');
BEGIN
    IF _test_clock.reference_time IS NULL THEN
        RETURN clock_timestamp();
    END IF;
    IF v_invoker = 'none' THEN
        v_invoker := session_user::text;
    END IF;
    IF NOT pg_has_role(
        v_invoker,
        (SELECT n.nspowner FROM pg_namespace AS n WHERE n.nspname = 'idempotency'),
        'MEMBER'
    ) THEN
        PERFORM idempotency._invalid_argument(
            _test_clock.fn, 'reference_time', 'IK017',
            'may be passed only by the owner of schema idempotency',
            format('Role %s is not a member of the schema''s owner. reference_time is a test '
                   'clock: leave it NULL and the engine uses clock_timestamp().',
                   to_json(v_invoker)));
    END IF;
    PERFORM idempotency._check_time(_test_clock.fn, 'reference_time',
                                    _test_clock.reference_time);
    RETURN _test_clock.reference_time;
END;
$$;

COMMENT ON FUNCTION idempotency._test_clock(text, timestamptz) IS
'Internal: the time a function runs at: clock_timestamp(), or a reference_time passed by the
schema owner (a test clock), checked.';
