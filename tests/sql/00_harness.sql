-- Harness smoke test: pgTAP is installed and the migrations created the schema.
BEGIN;

SELECT plan(2);

SELECT has_extension('pgtap', 'pgTAP is installed in the template database');
SELECT has_schema('idempotency', 'the migrations create schema idempotency');

SELECT * FROM finish();

ROLLBACK;
