-- Serializes every insert of one (a, b) pair until the end of the caller's transaction. The
-- two-int4 advisory lock space keeps us clear of applications' single-bigint advisory locks;
-- space says which table (1 = keys, 2 = inbox). A hash collision between two different pairs
-- only makes them wait for each other briefly; it can never merge them.
--
-- Without SET search_path so that it is inlined into the caller's query (a pinned search_path
-- prevents inlining); the functions it calls are schema-qualified instead.
CREATE FUNCTION idempotency._lock_name(space integer, a text, b text)
RETURNS void
LANGUAGE sql
VOLATILE
-- U+001F cannot occur in a or b (see _check_name), so the pair is encoded unambiguously.
RETURN pg_catalog.pg_advisory_xact_lock(
    space,
    pg_catalog.hashtext(
        a OPERATOR(pg_catalog.||) pg_catalog.chr(31) OPERATOR(pg_catalog.||) b
    )
);

COMMENT ON FUNCTION idempotency._lock_name(integer, text, text) IS
'Internal: transaction-scoped advisory lock on (a, b) in lock space "space".';
