-- One row per idempotency.maintain() run, written by maintain() itself at its end (never on the
-- claim/complete path), so idempotency.metrics() can say when maintenance last ran, how long
-- it took and what it did. A run that fails rolls back with its row: a failure shows as the
-- last run getting older (and in the scheduler's log, e.g. cron.job_run_details). maintain()
-- keeps the newest 1,000 rows.
CREATE TABLE idempotency.maintenance_runs (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    started_at timestamptz NOT NULL,
    finished_at timestamptz NOT NULL,
    -- The run's reference_time (now() unless a test moved it).
    reference_time timestamptz NOT NULL,
    -- ok: every step done | partial: some step skipped (a lock not granted in time, the newest
    -- partition kept, ...) | skipped: another run held the maintenance lock, nothing done
    outcome text NOT NULL,
    created integer NOT NULL,
    dropped integer NOT NULL,
    -- moved, deleted and tombstoned rows.
    rows_changed bigint NOT NULL,
    skipped_steps integer NOT NULL
);

COMMENT ON TABLE idempotency.maintenance_runs IS
'One row per idempotency.maintain() run (the newest 1,000): when, how long, outcome (ok,
partial, skipped) and what it did. Written only by maintain().';

COMMENT ON SEQUENCE idempotency.maintenance_runs_id_seq IS
'Numbers the rows of idempotency.maintenance_runs.';

REVOKE ALL ON idempotency.maintenance_runs FROM public;
