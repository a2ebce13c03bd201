-- Where the partition that holds a moment starts: its bin of partition_interval counted from
-- _partition_origin(). _premake, _make_partitions and _keep_from bin with it.
--
-- Without SET search_path, so that the planner inlines it where its arguments are columns (see
-- _name_ok). Where they are constants the planner runs it instead, through the SQL function
-- executor, which costs more than the whole date_bin expression (measured on complete()'s
-- guess, docs/design.md, "Performance decisions"): the guess that _make_routes generates,
-- planned afresh on every call on Citus, writes date_bin and the origin's value, not this call.
CREATE FUNCTION idempotency._partition_start(partition_interval interval, moment timestamptz)
RETURNS timestamptz
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
RETURN pg_catalog.date_bin(partition_interval, moment, idempotency._partition_origin());

COMMENT ON FUNCTION idempotency._partition_start(interval, timestamptz) IS
'Internal: the lower bound of the partition (of width partition_interval, counted from
_partition_origin()) that holds moment.';
