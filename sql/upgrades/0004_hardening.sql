-- Recipe of migrations/0004_hardening.sql (tools/build.py --migration 4 hardening); the syntax
-- is explained in sql/upgrades/0002_maintenance.sql.
--
-- 0004: results independent of the session's settings. Partition bounds were printed and read
-- back as text in the session's DateStyle and TimeZone, so under some settings maintain() read
-- every bound an hour early and dropped keys before their retention ended. Both functions that
-- turn bounds into text now pin DateStyle and TimeZone.

-- @replace functions/_partitions.sql
-- @replace functions/_create_partition.sql

-- As in sql/bootstrap.sql: nothing new is executable by PUBLIC.
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA idempotency FROM public;
