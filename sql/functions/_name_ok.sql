-- The happy-path test of _check_name's rules as one inlinable expression. A PL/pgSQL PERFORM
-- per argument runs a whole query; this is folded into the caller's IF as a plain expression,
-- and _check_name (which says what is wrong) runs only when it fails. Measured on the claim +
-- complete benchmark, validating through PERFORM cost about a fifth of the throughput.
--
-- Deliberately without SET search_path: a pinned search_path stops the planner from inlining
-- a SQL function. Every operator and function is schema-qualified instead.
--
-- Two function calls, not four: the expression is compiled again in every transaction that
-- calls the function (PL/pgSQL keeps a simple expression's state per transaction), and each
-- call in it costs its compilation (a permission check) and its evaluation. The anchored
-- regex says "not empty, no control character" in one call (it cannot say "at most 255": a
-- bounded repetition compiles to a far costlier automaton). NULL gives NULL, not false: every
-- caller wraps its test in coalesce(..., false). Measured with bench/instructions.py
-- (docs/design.md, "Performance decisions"). The length first: the regex works on a copy of
-- the whole text at four bytes a character, so a long value (a compressed one read from a
-- table is small as stored) must be refused before it; length() reads it once.
CREATE FUNCTION idempotency._name_ok(value text)
RETURNS boolean
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
RETURN (
    pg_catalog.length(value) OPERATOR(pg_catalog.<=) 255
    AND value OPERATOR(pg_catalog.~) '^[^[:cntrl:]]+$'
);

COMMENT ON FUNCTION idempotency._name_ok(text) IS
'Internal: true when value passes idempotency._check_name, false or NULL (for NULL) when it
does not (inlined into callers, which coalesce it to false).';
