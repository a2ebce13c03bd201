-- The IF ... ELSIF branches of a generated route (see _make_routes): one per partition, chosen
-- by the route's argument named arg falling in the partition's bounds, each running stmt on that
-- partition. '' when there is no partition; otherwise the text ends before its END IF.
CREATE FUNCTION idempotency._route_branches(
    fn text,
    arg text,
    stmt text,
    names text[],
    lowers timestamptz[],
    uppers timestamptz[]
)
RETURNS text
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
-- The bounds become literals in the generated text: ISO with a numeric UTC offset, which reads
-- back as the same instant under any DateStyle and TimeZone of the sessions that run it.
SET datestyle = 'ISO, YMD'
SET timezone = 'UTC'
AS $$
DECLARE
    v_branches text := '';
BEGIN
    FOR j IN 1 .. cardinality(_route_branches.names) LOOP
        -- replace(), not format(), for the statement: a partition's name may hold a %.
        -- The table's name goes in last, so nothing in it is replaced.
        v_branches := v_branches || format(
            E'\n    %1$s %2$s.%6$I >= %3$L::timestamptz'
            || ' AND %2$s.%6$I < %4$L::timestamptz'
            || E'\n       AND to_regclass(%5$L) IS NOT NULL THEN',
            CASE WHEN v_branches = '' THEN 'IF' ELSE 'ELSIF' END, _route_branches.fn,
            _route_branches.lowers[j], _route_branches.uppers[j], _route_branches.names[j],
            _route_branches.arg)
            || replace(_route_branches.stmt, '@table@', _route_branches.names[j]);
    END LOOP;
    RETURN v_branches;
END;
$$;

COMMENT ON FUNCTION idempotency._route_branches(
    text, text, text, text[], timestamptz[], timestamptz[]
) IS
'Internal (_make_routes): the IF/ELSIF branches of a generated route, one static statement per
partition of keys, chosen by the argument arg.';
