-- The moment the partitions' bins are counted from. Partitions of keys, inbox and tombstones
-- are aligned on settings.partition_interval from 2000-01-01 00:00 UTC, so that every
-- installer, every run of maintain() and every node of a cluster computes the same bounds.
-- This is the one place that origin is written: _partition_start bins with it (for _premake,
-- _make_partitions and _keep_from), and _make_routes writes its value into complete()'s guess
-- on Citus, so a guess and the partition it must land in cannot disagree.
--
-- Without SET search_path, so that the planner can inline it (see _name_ok).
CREATE FUNCTION idempotency._partition_origin()
RETURNS timestamptz
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
RETURN timestamptz '2000-01-01 00:00:00+00';

COMMENT ON FUNCTION idempotency._partition_origin() IS
'Internal: the moment the partitions'' bins are counted from (2000-01-01 00:00 UTC).';
