-- Cross-partition uniqueness relies on reading the key after taking its advisory lock with a
-- snapshot taken after the lock. READ COMMITTED gives every statement a new snapshot; REPEATABLE
-- READ and SERIALIZABLE reuse the snapshot taken at the transaction's first statement, which can
-- predate a claim that committed while this one waited for the lock, and would then insert a
-- second row for the same key in another partition. So those levels are refused, not guessed at.
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
