-- The range of every time argument (reference_time): a finite time from 1970-01-01 00:00 UTC up
-- to, not including, 9999-01-01 00:00 UTC. Inside it no arithmetic of the engine overflows (a
-- lease, a retention, the partitions made ahead of maintain()'s time: 294276-12-31 raised 22008
-- from inside maintain()), and nothing is made for a past before any key (maintain('1960-01-01')
-- made partitions for 1960). Refused with IK014 naming fn's argument.
CREATE FUNCTION idempotency._check_time(fn text, argument text, value timestamptz)
RETURNS void
LANGUAGE plpgsql
IMMUTABLE
PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NOT isfinite(_check_time.value)
       OR _check_time.value < timestamptz '1970-01-01 00:00:00+00'
       OR _check_time.value >= timestamptz '9999-01-01 00:00:00+00' THEN
        PERFORM idempotency._invalid_argument(
            _check_time.fn, _check_time.argument, 'IK014',
            'must be a finite time from 1970 to 9998',
            format('It is %s.', _check_time.value));
    END IF;
END;
$$;

COMMENT ON FUNCTION idempotency._check_time(text, text, timestamptz) IS
'Internal: raise IK014 unless value is a finite time from 1970-01-01 to 9998-12-31 (UTC).';
