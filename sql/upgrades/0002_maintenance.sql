-- Recipe of migrations/0002_maintenance.sql (tools/build.py --migration 2 maintenance):
-- plain SQL, plus "-- @include FILE" (a source from sql/, as it is) and "-- @replace FILE" (a
-- changed function, as CREATE OR REPLACE FUNCTION, which keeps its grants) lines that
-- tools/build.py expands. tests/test_install.py checks that 0001 + 0002 give the same schema as
-- a fresh install from sql/.
--
-- 0002: retention by partitions (maintain), tombstones, scheduling, status.

-- New settings, appended in the order sql/tables/settings.sql lists them.
ALTER TABLE idempotency.settings
ADD COLUMN tombstones boolean NOT NULL DEFAULT false,
ADD COLUMN tombstone_retention interval NOT NULL DEFAULT '30 days'
CHECK (extract(MONTH FROM tombstone_retention) = 0),
ADD COLUMN manage_partitions boolean NOT NULL DEFAULT true,
ADD COLUMN maintenance_lock_timeout interval NOT NULL DEFAULT '200 milliseconds'
CHECK (
    maintenance_lock_timeout >= interval '1 millisecond'
    AND maintenance_lock_timeout <= interval '1 minute'
),
ADD CONSTRAINT settings_tombstones_outlive_keys CHECK (tombstone_retention > retention);

COMMENT ON TABLE idempotency.settings IS
'pg_idempotency settings (exactly one row): partition_interval, retention, premake, tombstones,
tombstone_retention, manage_partitions, maintenance_lock_timeout.';

-- @include tables/tombstones.sql
-- @include types/maintenance_action.sql
-- @include types/key_status.sql
-- @include types/partition_status.sql
-- @replace functions/_create_partition.sql
-- @replace functions/claim.sql
-- @include functions/_partitions.sql
-- @include functions/_write_tombstones.sql
-- @include functions/_make_partitions.sql
-- @include functions/maintain.sql
-- @include functions/key_status.sql
-- @include functions/partition_status.sql
-- @include functions/_require_pg_cron.sql
-- @include functions/schedule_maintenance.sql
-- @include functions/unschedule_maintenance.sql

-- As in sql/bootstrap.sql: nothing new is executable by PUBLIC.
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA idempotency FROM public;
