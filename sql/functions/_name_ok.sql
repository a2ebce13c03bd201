-- The happy-path test of _check_name's rules as one inlinable expression. A PL/pgSQL PERFORM
-- per argument runs a whole query; this is folded into the caller's IF as a plain expression,
-- and _check_name (which says what is wrong) runs only when it fails. Measured on the claim +
-- complete benchmark, validating through PERFORM cost about a fifth of the throughput.
--
-- Deliberately without SET search_path: a pinned search_path stops the planner from inlining
-- a SQL function. Every operator and function is schema-qualified instead.
CREATE FUNCTION idempotency._name_ok(value text)
RETURNS boolean
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
RETURN (
    value IS NOT NULL
    AND value OPERATOR(pg_catalog.<>) ''
    AND pg_catalog.length(value) OPERATOR(pg_catalog.<=) 255
    AND value OPERATOR(pg_catalog.!~) '[[:cntrl:]]'
);

COMMENT ON FUNCTION idempotency._name_ok(text) IS
'Internal: true when value passes idempotency._check_name (inlined into callers).';
