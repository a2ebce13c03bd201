-- The happy-path test of _check_lease, inlinable for the same reason as _name_ok (and likewise
-- without SET search_path, with qualified operators).
CREATE FUNCTION idempotency._lease_ok(value interval)
RETURNS boolean
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
RETURN (
    value IS NOT NULL
    AND value OPERATOR(pg_catalog.>) interval '0'
    AND value OPERATOR(pg_catalog.<=) interval '1 day'
);

COMMENT ON FUNCTION idempotency._lease_ok(interval) IS
'Internal: true when value passes idempotency._check_lease (inlined into callers).';
