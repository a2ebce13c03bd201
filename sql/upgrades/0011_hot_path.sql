-- Recipe of migrations/0011_hot_path.sql (tools/build.py --migration 11 hot_path); the syntax
-- is explained in sql/upgrades/0002_maintenance.sql. Self-contained: only the objects added or
-- changed here.
--
-- 0011 (0.11.0): the hot path of claim and complete, size limits, completers limited to
-- scopes, lease outcomes as values, and custom plans on Citus.
-- - complete() and complete_bytes() check their arguments themselves and call the generated
--   route _complete_row directly: two PL/pgSQL levels instead of three. _finish goes.
-- - _complete_row, given created_at NULL, first tries the partition that holds the
--   completion's own time (its guess) and reads key_directory only when that finds no row:
--   the directory read leaves complete's success path. Same signature, same answers (IK001 /
--   IK004 through _lease_error).
-- - _make_routes builds its branches with the new _route_branches(), today's partition first
--   (the ones made ahead last); without partitions (Citus) _complete_row's guess is the UPDATE
--   on the parent for a key created in the same partition in the hour up to the completion.
-- - On a Citus cluster, the per-key functions plan each statement afresh (force_custom_plan):
--   with generic plans, Citus's local plan cache grew in every session with every
--   claim + complete (_citus_custom_plans, called by distribute() and from here on by every
--   migration's end, since a migration puts the sources' generic plans back).
-- Table changes, no data moved: settings gains max_request_bytes, max_response_bytes and
-- max_headers_bytes (with defaults and CHECK constraints); grants gains scopes (NULL for the
-- roles granted before: every scope); a new table completer_grants mirrors them; a new type
-- lease_outcome. grant_usage(regrole, text) and _finish are dropped (grant_usage has a new
-- signature with scopes; the old call shape still works through its defaults).

-- The partitions' origin (2000-01-01 00:00 UTC) written once, in _partition_origin, which
-- _partition_start (for _premake, _make_partitions, _keep_from) and complete()'s guess on
-- Citus bin with. Same bounds.
-- @include functions/_partition_origin.sql
-- @include functions/_partition_start.sql
-- @replace functions/_premake.sql
-- @replace functions/_make_partitions.sql
-- @include functions/_route_branches.sql
-- @include functions/_shard_branches.sql
-- @include functions/_local_shards.sql
-- @include functions/_claim_row_local.sql
-- @replace functions/_make_routes.sql
SELECT idempotency._make_routes() AS routes_made;
-- @replace functions/complete.sql
-- @replace functions/complete_bytes.sql
-- @include functions/_citus_custom_plans.sql
-- @replace functions/distribute.sql
DROP FUNCTION idempotency._finish(
    text, text, text, bigint, integer, jsonb, jsonb, bytea, text, timestamptz
);

-- Size limits: settings.max_request_bytes, max_response_bytes and
-- max_headers_bytes, refused with IK018 before anything is canonicalized or stored.
-- One statement per column and per constraint, each constraint named: Citus refuses an ADD
-- COLUMN that carries a constraint on a distributed install (settings is a reference table).
ALTER TABLE idempotency.settings
ADD COLUMN max_request_bytes integer NOT NULL DEFAULT 1048576;
ALTER TABLE idempotency.settings
ADD COLUMN max_response_bytes integer NOT NULL DEFAULT 1048576;
ALTER TABLE idempotency.settings
ADD COLUMN max_headers_bytes integer NOT NULL DEFAULT 16384;
ALTER TABLE idempotency.settings ADD CONSTRAINT settings_max_request_bytes_check
CHECK (max_request_bytes BETWEEN 65536 AND 1073741824);
ALTER TABLE idempotency.settings ADD CONSTRAINT settings_max_response_bytes_check
CHECK (max_response_bytes BETWEEN 65536 AND 1073741824);
ALTER TABLE idempotency.settings ADD CONSTRAINT settings_max_headers_bytes_check
CHECK (max_headers_bytes BETWEEN 4096 AND 1048576);
COMMENT ON TABLE idempotency.settings IS
'pg_idempotency settings (exactly one row): partition_interval, retention, premake, tombstones,
tombstone_retention, manage_partitions, maintenance_lock_timeout, max_request_bytes,
max_response_bytes, max_headers_bytes.';
-- @include functions/_check_size.sql
-- @replace functions/claim.sql
-- @replace functions/accept.sql
-- @replace functions/fingerprint.sql
-- @replace functions/canonical_json.sql
-- derive_key stays IMMUTABLE: it calls _canonical_json itself, no longer the STABLE one.
-- @replace functions/derive_key.sql
-- maintain()'s rule for the newest rows in one function, which partition_status() and
-- metrics() follow too: what they call due is what the next run drops.
-- @include functions/_keep_from.sql
-- @replace functions/metrics.sql
-- @replace functions/partition_status.sql

-- Time arguments checked against one range (IK014, never 22008 from inside), and maintain()
-- never drops or deletes the newest interval holding rows, so no reference_time empties a
-- table. The functions only the coordinator serves answer IK022 on a Citus worker.
-- @include functions/_check_time.sql
-- @include functions/_require_coordinator.sql
-- @replace functions/_test_clock.sql
-- @replace functions/_maintain.sql
-- @replace functions/maintain.sql
-- @replace functions/key_status.sql
-- @replace functions/metrics_by_scope.sql
-- @replace functions/schedule_maintenance.sql
-- @replace functions/unschedule_maintenance.sql

-- Completers limited to scopes: grant_usage(..., scopes => ...), recorded in
-- grants.scopes and mirrored by role name into completer_grants (a reference table on Citus),
-- which takeover() and list_abandoned() check (_completer_scopes, IK023). The roles granted
-- before keep every scope: their rows get scopes NULL, and the _reapply_grants() at the end of
-- this migration fills the mirror.
ALTER TABLE idempotency.grants ADD COLUMN scopes text[];
COMMENT ON TABLE idempotency.grants IS
'Roles let in by idempotency.grant_usage() and their kind (request, completer, monitor), and a
completer''s scopes (NULL: every scope); re-applied by every migration from 0010 on.';
-- @include tables/completer_grants.sql
-- @include functions/_completer_scopes.sql
-- @include functions/_mirror_completer_grants.sql
DROP FUNCTION idempotency.grant_usage(regrole, text);
-- @include functions/grant_usage.sql
-- @replace functions/_reapply_grants.sql
-- @replace functions/takeover.sql
-- @replace functions/list_abandoned.sql
-- list_keys(older_than): at most 1000 years (IK014), never 22008 from inside.
-- @replace functions/list_keys.sql
-- No timing oracle on wrong tokens: a key missing from key_directory is looked for
-- in the partition of now, so every key state costs the same statements.
-- @include functions/_lease_outcome.sql
-- @replace functions/_lease_error.sql
-- @replace functions/heartbeat.sql
-- @replace functions/checkpoint.sql
-- @replace functions/release.sql
-- Outcomes instead of errors: on Citus every error raised on a worker costs the
-- session a new worker connection. heartbeat_outcome, checkpoint_outcome and release_outcome
-- answer lease_lost / completed as a value (type lease_outcome) where heartbeat, checkpoint and
-- release raise IK001 / IK004, which they still do. New objects: a distributed install runs
-- idempotency.distribute() again after this migration to delegate them (docs/scale-out.md).
-- @include types/lease_outcome.sql
-- @include functions/heartbeat_outcome.sql
-- @include functions/checkpoint_outcome.sql
-- @include functions/release_outcome.sql

-- Fewer calls in the expressions the hot path compiles in every transaction: _name_ok tests
-- "not empty, no control character" with one anchored regex; _new_token hashes its UUID
-- (uuid_hash) instead of casting it through text and bit.
-- Same answers, same token layout. The functions that inline them are replaced above or
-- re-planned by PostgreSQL when these change.
-- @replace functions/_name_ok.sql
-- @replace functions/_new_token.sql

-- As in sql/bootstrap.sql: nothing new is executable by PUBLIC.
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA idempotency FROM public;
