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
    premake integer NOT NULL DEFAULT 3 CHECK (premake BETWEEN 1 AND 366),
    -- The columns below came with migration 0002 (maintenance); ALTER TABLE ADD COLUMN appends,
    -- so they stay last here to keep a fresh install identical to an upgraded one.
    -- Opt-in: when maintain() drops expired keys it first keeps a compact record of each (see
    -- idempotency.tombstones), and a retry of such a key gets outcome 'expired'.
    tombstones boolean NOT NULL DEFAULT false,
    -- How long a tombstone is kept (measured from the key's created_at, like retention).
    tombstone_retention interval NOT NULL DEFAULT '30 days'
    CHECK (extract(MONTH FROM tombstone_retention) = 0),
    -- false: maintain() leaves the partitions of keys and inbox alone (pg_partman manages them).
    manage_partitions boolean NOT NULL DEFAULT true,
    -- How long maintain() waits for a lock on a table before it skips a step: a drop or create
    -- must never queue an exclusive lock in front of live claims for long.
    maintenance_lock_timeout interval NOT NULL DEFAULT '200 milliseconds'
    CHECK (
        maintenance_lock_timeout >= interval '1 millisecond'
        AND maintenance_lock_timeout <= interval '1 minute'
    ),
    -- Tombstones outlive the keys they stand for, or there would be no window for them.
    CONSTRAINT settings_tombstones_outlive_keys CHECK (tombstone_retention > retention),
    -- The columns below came with migration 0011 (size limits, refused with IK018 before
    -- anything is canonicalized or stored; see _check_size). Bytes uncompressed (since 0.13.0;
    -- a value read from a table may be compressed): pg_column_size of a jsonb (_raw_size),
    -- octet_length of a bytea. The floors (64 KiB, 4 KiB) are what keeps this row off the hot
    -- path: a function reads it only for an argument above them, or a compressed one.
    -- claim(request), fingerprint(request, defaults, fields), canonical_json(value).
    max_request_bytes integer NOT NULL DEFAULT 1048576
    CHECK (max_request_bytes BETWEEN 65536 AND 1073741824),
    -- The body given to complete, complete_bytes and accept (JSON or bytes).
    max_response_bytes integer NOT NULL DEFAULT 1048576
    CHECK (max_response_bytes BETWEEN 65536 AND 1073741824),
    -- The headers given to complete, complete_bytes and accept.
    max_headers_bytes integer NOT NULL DEFAULT 16384
    CHECK (max_headers_bytes BETWEEN 4096 AND 1048576)
);

COMMENT ON TABLE idempotency.settings IS
'pg_idempotency settings (exactly one row): partition_interval, retention, premake, tombstones,
tombstone_retention, manage_partitions, maintenance_lock_timeout, max_request_bytes,
max_response_bytes, max_headers_bytes.';

-- The row is not inserted here but by the first idempotency._premake() (sql/bootstrap.sql runs
-- it at install). Inside CREATE EXTENSION a row made by the script could never be dumped: the
-- restore runs the script again, and loading the dumped row would then collide with it.

REVOKE ALL ON idempotency.settings FROM public;
