-- A single-row table: the engine reads it only off the hot path (partition management), so a
-- claim never pays for a settings lookup.
CREATE TABLE idempotency.settings (
    id boolean PRIMARY KEY DEFAULT true CHECK (id),
    -- Width of one partition of idempotency.keys and idempotency.inbox.
    partition_interval interval NOT NULL DEFAULT '1 day'
    CHECK (
        partition_interval >= interval '1 hour'
        AND partition_interval <= interval '31 days'
        AND extract(MONTH FROM partition_interval) = 0
    ),
    -- How long a key is kept at least (measured from created_at) before its partition may go.
    retention interval NOT NULL DEFAULT '24 hours'
    CHECK (retention >= interval '1 hour' AND extract(MONTH FROM retention) = 0),
    -- How many partitions ahead of the current one are kept ready.
    premake integer NOT NULL DEFAULT 3 CHECK (premake BETWEEN 1 AND 366)
);

COMMENT ON TABLE idempotency.settings IS
'pg_idempotency settings (exactly one row): partition_interval, retention, premake.';

-- The row is not inserted here but by the first idempotency._premake() (sql/bootstrap.sql runs
-- it at install). Inside CREATE EXTENSION a row made by the script could never be dumped: the
-- restore runs the script again, and loading the dumped row would then collide with it.

REVOKE ALL ON idempotency.settings FROM public;
