-- Writes a tombstone for every key of one partition of idempotency.keys (a ranged partition
-- about to be dropped, or keys_default, then limited to rows created before "before") whose
-- tombstone would still be alive at reference_time. Returns how many it wrote.
--
-- maintain() calls it before it takes any exclusive lock, and drops the keys in the same
-- transaction: a claim sees either the key or its tombstone, never neither (docs/design.md).
-- Written again (ON CONFLICT DO UPDATE) when an earlier run wrote it but could not drop the
-- partition, so the final state is the latest one.
CREATE FUNCTION idempotency._write_tombstones(
    source text, before timestamptz, tombstone_retention interval, reference_time timestamptz
)
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_written bigint;
BEGIN
    EXECUTE format(
        'INSERT INTO idempotency.tombstones AS t (scope, key_hash, fingerprint, final_state, '
        '    response_status, created_at, expires_at) '
        'SELECT k.scope, idempotency._key_hash(k.key), '
        '    k.fingerprint, k.state, k.response_status, k.created_at, k.created_at + $1 '
        'FROM idempotency.%I AS k '
        -- A released key stands for no effect: its retry must run, not answer expired.
        'WHERE k.created_at < $2 AND k.state <> ''released'' '
        '  AND k.created_at + $1 > $3 '
        'ON CONFLICT (scope, key_hash, created_at) DO UPDATE '
        'SET final_state = excluded.final_state, response_status = excluded.response_status, '
        '    expires_at = excluded.expires_at',
        _write_tombstones.source)
    USING _write_tombstones.tombstone_retention, _write_tombstones.before,
          _write_tombstones.reference_time;
    GET DIAGNOSTICS v_written = ROW_COUNT;
    RETURN v_written;
END;
$$;

COMMENT ON FUNCTION idempotency._write_tombstones(text, timestamptz, interval, timestamptz) IS
'Internal: write tombstones for the keys of partition source created before "before"; returns
how many.';
