-- The shard branches of a generated local half (see _make_routes, Citus only): stmts[i] when
-- v_shard = shards[i], chosen by a balanced tree of IF v_shard < ... tests, so that a call runs
-- about log2(shards) tests, not one per shard (PL/pgSQL builds each test's executor state once
-- per transaction, a cost paid per test). A v_shard that is in no leaf (a shard a split
-- made after the routes were generated) runs nothing. '' for no shard.
CREATE FUNCTION idempotency._shard_branches(
    shards bigint[],
    stmts text[],
    indent text DEFAULT '    '
)
RETURNS text
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_count integer := coalesce(cardinality(_shard_branches.shards), 0);
    v_upper integer;
BEGIN
    IF v_count = 0 THEN
        RETURN '';
    ELSIF v_count = 1 THEN
        RETURN format(E'\n%sIF v_shard = %s THEN', _shard_branches.indent,
                      _shard_branches.shards[1])
            || _shard_branches.stmts[1]
            || format(E'\n%sEND IF;', _shard_branches.indent);
    END IF;
    -- The first index of the upper half.
    v_upper := v_count / 2 + 1;
    RETURN format(E'\n%sIF v_shard < %s THEN', _shard_branches.indent,
                  _shard_branches.shards[v_upper])
        || idempotency._shard_branches(_shard_branches.shards[1:v_upper - 1],
                                       _shard_branches.stmts[1:v_upper - 1],
                                       _shard_branches.indent || '    ')
        || format(E'\n%sELSE', _shard_branches.indent)
        || idempotency._shard_branches(_shard_branches.shards[v_upper:],
                                       _shard_branches.stmts[v_upper:],
                                       _shard_branches.indent || '    ')
        || format(E'\n%sEND IF;', _shard_branches.indent);
END;
$$;

COMMENT ON FUNCTION idempotency._shard_branches(bigint[], text[], text) IS
'Internal (_make_routes, Citus): a balanced tree of IF tests on v_shard running stmts[i] for
shards[i] (sorted ascending).';
