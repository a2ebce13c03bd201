-- A lease must be positive and at most one day. A longer lease is almost always a unit mistake
-- (seconds passed as days) and would keep a crashed worker's key locked past the retention
-- window; long operations keep a short lease alive with heartbeat() instead.
CREATE FUNCTION idempotency._check_lease(fn text, argument text, value interval)
RETURNS void
LANGUAGE plpgsql
IMMUTABLE
PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF _check_lease.value IS NULL THEN
        PERFORM idempotency._invalid_argument(_check_lease.fn, _check_lease.argument, 'IK010',
                                              'must not be NULL');
    ELSIF _check_lease.value <= interval '0' OR _check_lease.value > interval '1 day' THEN
        PERFORM idempotency._invalid_argument(
            _check_lease.fn, _check_lease.argument, 'IK014',
            'must be greater than 0 and at most 1 day',
            format('It is %s.', _check_lease.value));
    END IF;
END;
$$;

COMMENT ON FUNCTION idempotency._check_lease(text, text, interval) IS
'Internal: validate a lease length (greater than 0, at most 1 day).';
