-- Cross-partition uniqueness is decided by key_directory's primary key: a claim whose INSERT
-- ... ON CONFLICT waited for a concurrent claim of the same key and did nothing reads the
-- winner's rows with its next statement. READ COMMITTED gives that statement a snapshot taken
-- after the wait; REPEATABLE READ and SERIALIZABLE reuse the transaction's first snapshot,
-- which can predate the winner's commit (PostgreSQL then raises 40001 where a retry needs the
-- answer in_progress). So those levels are refused, not guessed at (docs/design.md,
-- "Uniqueness of (scope, key) across partitions").
CREATE FUNCTION idempotency._require_read_committed(fn text)
RETURNS void
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION USING
            MESSAGE = format('%s must run at READ COMMITTED, not %s', _require_read_committed.fn,
                             upper(current_setting('transaction_isolation'))),
            ERRCODE = 'IK005',
            DETAIL = 'Its lookup across partitions needs a snapshot taken after the key lock.',
            HINT = 'Call it in its own transaction (autocommit) or in a READ COMMITTED one; '
                || 'complete() may run in a transaction of any isolation level.';
    END IF;
END;
$$;

COMMENT ON FUNCTION idempotency._require_read_committed(text) IS
'Internal: raise IK005 unless the transaction is READ COMMITTED.';
