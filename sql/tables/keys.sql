-- One row per (scope, key) while the key is retained. Partitioned by created_at so retention is
-- a partition drop instead of a DELETE storm.
--
-- Uniqueness of (scope, key) across partitions: PostgreSQL cannot enforce it with an index,
-- because a unique index on a partitioned table must contain the partition column. The primary
-- key below is unique per (scope, key, created_at) only; cross-partition uniqueness is enforced
-- by the only code path that inserts, idempotency.claim(): it takes a transaction-scoped
-- advisory lock on (scope, key), then looks the key up in every partition (but those starting
-- more than an hour after its clock: see claim) with a fresh READ COMMITTED snapshot, and
-- inserts only when nothing is found. See docs/design.md.
CREATE TABLE idempotency.keys (
    scope text NOT NULL,
    key text NOT NULL,
    -- sha256 of the canonical request (idempotency.fingerprint) or one supplied by the caller.
    fingerprint bytea NOT NULL,
    -- 'in_progress' or 'completed'.
    state text NOT NULL,
    -- Fencing token of the current owner; replaced on every takeover.
    lease_token bigint NOT NULL,
    lease_expires_at timestamptz,
    recovery_point text,
    attempts integer NOT NULL DEFAULT 1,
    response_status integer,
    response_headers jsonb,
    response_body jsonb,
    response_body_bytes bytea,
    response_content_type text,
    created_at timestamptz NOT NULL,
    completed_at timestamptz,
    PRIMARY KEY (scope, key, created_at)
) PARTITION BY RANGE (created_at);

-- No CHECK constraints, on purpose: PostgreSQL re-reads every CHECK expression from the catalog
-- for each INSERT and UPDATE statement, which on this table cost about 5% of claim + complete
-- throughput. Only the idempotency.* functions write here (no role has table privileges), they
-- validate every value first, and tests/sql assert the invariants these checks would state:
-- fingerprint is 32 bytes; state is in_progress (lease_expires_at set; response_* set only by
-- accept(), the interim response of a long-running operation) or completed (response_status
-- and completed_at set); at most one of response_body, response_body_bytes.

-- No index serves idempotency.list_abandoned(): an index on lease_expires_at (or a partial one
-- on state) would make every complete() a non-HOT update and cost the hot path a second index
-- write, for a query that background completers run rarely. It scans in-progress rows instead.

COMMENT ON TABLE idempotency.keys IS
'Idempotency keys: one row per (scope, key), partitioned by created_at. Written only through the
idempotency.* functions.';

REVOKE ALL ON idempotency.keys FROM public;

-- The safety net: a claim never fails for want of a partition. Rows land here only when
-- partitions were not made ahead (see idempotency._premake); maintenance moves them out.
CREATE TABLE idempotency.keys_default PARTITION OF idempotency.keys DEFAULT;

REVOKE ALL ON idempotency.keys_default FROM public;
