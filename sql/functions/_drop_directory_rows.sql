-- maintain(), phase 1: deletes the directory rows (see sql/tables/key_directory.sql) of the keys,
-- tombstones or messages in one partition of parent ('keys', 'tombstones' or 'inbox') that are
-- about to go, those
-- dated before "before" (the default partitions) or all of them (a ranged partition about to be
-- dropped). A key that got a tombstone keeps its row, now pointing at the tombstone, until the
-- tombstone goes. Returns how many rows it deleted.
--
-- One small row per key, by primary key, joined on the scope: on Citus it runs on every shard
-- at once, next to the rows it reads.
CREATE FUNCTION idempotency._drop_directory_rows(parent text, source text, before timestamptz)
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_deleted bigint;
BEGIN
    IF _drop_directory_rows.parent = 'keys' THEN
        EXECUTE format(
            'DELETE FROM idempotency.key_directory AS d USING idempotency.%I AS k '
            'WHERE d.scope = k.scope AND d.key_hash = idempotency._key_hash(k.key) '
            '  AND d.created_at = k.created_at AND k.created_at < $1 '
            '  AND NOT EXISTS (SELECT FROM idempotency.tombstones AS t '
            '                  WHERE t.scope = d.scope AND t.key_hash = d.key_hash '
            '                    AND t.created_at = d.created_at)',
            _drop_directory_rows.source)
        USING _drop_directory_rows.before;
    ELSIF _drop_directory_rows.parent = 'inbox' THEN
        -- A message's row: (consumer, sha256 of U+001F and the message id); see inbox_accept.
        EXECUTE format(
            'DELETE FROM idempotency.key_directory AS d USING idempotency.%I AS i '
            'WHERE d.scope = i.consumer '
            '  AND d.key_hash = idempotency._key_hash(chr(31) || i.message_id) '
            '  AND d.created_at = i.received_at AND i.received_at < $1',
            _drop_directory_rows.source)
        USING _drop_directory_rows.before;
    ELSE
        EXECUTE format(
            'DELETE FROM idempotency.key_directory AS d USING idempotency.%I AS t '
            'WHERE d.scope = t.scope AND d.key_hash = t.key_hash '
            '  AND d.created_at = t.created_at AND t.created_at < $1',
            _drop_directory_rows.source)
        USING _drop_directory_rows.before;
    END IF;
    GET DIAGNOSTICS v_deleted = ROW_COUNT;
    RETURN v_deleted;
END;
$$;

COMMENT ON FUNCTION idempotency._drop_directory_rows(text, text, timestamptz) IS
'Internal (maintain, phase 1): delete the key_directory rows of the keys, tombstones or inbox
messages of partition source dated before "before"; returns how many.';
