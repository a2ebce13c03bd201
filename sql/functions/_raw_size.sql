-- The size of a jsonb as the caller means it: its uncompressed size, whatever its origin. A
-- value read from a table may be compressed (inline, or in TOAST with pglz or lz4), and
-- pg_column_size measures it as stored: 200 MB of repeated JSON read from a table measured
-- 0.8 MB, passed every size limit, and claim() canonicalized it (1.75 GB in one backend).
--
-- Callers test pg_column_compression(value) IS NULL in the expression that already measures
-- the value (it reads the datum's header, or its TOAST pointer), so an ordinary value, sent by
-- the client and never compressed, pays nothing more; only a compressed one comes here. `#>
-- '{}'` (no path) returns the jsonb it was given, decompressed: the one copy this costs, the
-- value's raw size, is freed with the expression, and nothing canonicalizes, hashes or stores
-- it.
--
-- SQL, without SET search_path and with qualified operators, so that it is inlined into the
-- caller's expression (as _name_ok is); STABLE as the functions it calls are (an IMMUTABLE
-- one calling them is not inlined, and PostgreSQL 18 then planned the call with the value as
-- a constant, copying 200 MB seven times). For the same reason a PL/pgSQL caller assigns it
-- to a variable (a simple expression, planned without the variable's value) and passes that
-- on: as an argument of a PERFORM, a statement planned with its variables' values as
-- constants, the decompressed value was folded into the plan and copied (1.5 GB for 200 MB).
CREATE FUNCTION idempotency._raw_size(value jsonb)
RETURNS integer
LANGUAGE sql
STABLE
PARALLEL SAFE
RETURN CASE
    WHEN pg_catalog.pg_column_compression(value) IS NULL THEN pg_catalog.pg_column_size(value)
    ELSE pg_catalog.pg_column_size(value OPERATOR(pg_catalog.#>) '{}'::pg_catalog.text[])
END;

COMMENT ON FUNCTION idempotency._raw_size(jsonb) IS
'Internal: the uncompressed size of value in bytes (pg_column_size measures a compressed value
as stored).';
