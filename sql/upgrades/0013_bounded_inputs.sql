-- Recipe of migrations/0013_bounded_inputs.sql (tools/build.py --migration 13
-- bounded_inputs); the syntax is explained in sql/upgrades/0002_maintenance.sql.
-- Self-contained: only the objects added or changed here.
--
-- 0013 (0.13.0): every limit holds whatever the input's origin, and maintain() keeps every key
-- for its retention whatever reference time it is given.
-- - A request, body or headers read from a table may be compressed, and pg_column_size
--   measured it as stored (200 MB of repeated JSON measured 0.8 MB): claim, accept, complete,
--   complete_bytes (headers), fingerprint (request, defaults, and fields, newly limited) and
--   canonical_json measure a compressed value uncompressed (the new _raw_size); an
--   uncompressed one pays one header test more. _name_ok measures a name's length before its
--   regex runs on it.
-- - _check_size raises every IK018, the canonical text's too (canonical => true; the DETAIL
--   says it is the canonical JSON): _check_canonical_size is dropped.
-- - maintain() measures what drops or expires from now() when reference_time is later, and
--   records that time in maintenance_runs.reference_time; partitions are still made ahead of
--   reference_time.
-- - A fourth kind of role, grant_usage(kind => 'maintainer'), for schedulers: maintain() at
--   the clock, schedule_maintenance, unschedule_maintenance and the status reads. maintain(),
--   key_status() and partition_status() become SECURITY DEFINER for it (CREATE OR REPLACE
--   keeps their grants).
-- - _canonical_json counts the copies a deep value holds (enclosing): IK018 above 8 times
--   max_request_bytes.
-- No table changes; no data moves.

DROP FUNCTION idempotency._check_canonical_size(text, text, integer);
DROP FUNCTION idempotency._check_size(text, text, integer, text);
-- @include functions/_check_size.sql
-- @include functions/_raw_size.sql
-- @replace functions/_name_ok.sql
DROP FUNCTION idempotency._canonical_json(jsonb, text, text, integer, boolean);
-- @include functions/_canonical_json.sql
-- @replace functions/canonical_json.sql
-- @replace functions/fingerprint.sql
-- @replace functions/claim.sql
-- @replace functions/accept.sql
-- @replace functions/complete.sql
-- @replace functions/complete_bytes.sql
-- @replace functions/_maintain.sql
-- @replace functions/maintain.sql
-- @replace functions/key_status.sql
-- @replace functions/partition_status.sql
-- @replace functions/grant_usage.sql

COMMENT ON TABLE idempotency.grants IS
'Roles let in by idempotency.grant_usage() and their kind (request, completer, monitor,
maintainer), and a completer''s scopes (NULL: every scope); re-applied by every migration
from 0010 on.';

-- As in sql/bootstrap.sql: nothing new is executable by PUBLIC.
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA idempotency FROM public;
