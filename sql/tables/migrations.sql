-- One row per applied migration file. Each migration inserts its own row, so the record is the
-- same whether it was applied by `pg-idempotency migrate`, psql, Flyway or golang-migrate.
CREATE TABLE IF NOT EXISTS idempotency.migrations (
    version integer PRIMARY KEY,
    name text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

COMMENT ON TABLE idempotency.migrations IS
'Applied pg_idempotency migrations (one row per migrations/NNNN_*.sql file).';

REVOKE ALL ON idempotency.migrations FROM public;
