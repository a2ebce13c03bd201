// Runs payment.mjs (the Node example of docs/other-languages.md) against a database with the
// schema installed: node payment_check.mjs DSN. Exits non-zero when an answer is not the
// documented one.
import assert from 'node:assert/strict';
import pg from 'pg';
import { createCharge } from './payment.mjs';

const pool = new pg.Pool({ connectionString: process.argv[2], max: 2 });
try {
  await pool.query('DROP TABLE IF EXISTS charges');
  await pool.query('CREATE TABLE charges (id bigserial PRIMARY KEY, account text NOT NULL, amount integer NOT NULL)');
  const key = `order-${process.pid}`;

  const first = await createCharge(pool, 'acct_42', key, { amount: 50, currency: 'EUR' });
  assert.equal(first.status, 201);
  assert.deepEqual(first.body.amount, 50);

  const again = await createCharge(pool, 'acct_42', key, { currency: 'EUR', amount: 50 });
  assert.deepEqual(again, { ...first, headers: { ...first.headers, 'Idempotent-Replayed': 'true' } });

  const other = await createCharge(pool, 'acct_42', key, { amount: 51, currency: 'EUR' });
  assert.equal(other.status, 422);

  // Another worker holds a live lease on a second key.
  await pool.query("SELECT idempotency.claim('acct_42', $1, '{\"amount\": 7}')", [`${key}-b`]);
  const busy = await createCharge(pool, 'acct_42', `${key}-b`, { amount: 7 });
  assert.equal(busy.status, 409);
  assert.ok(Number(busy.headers['Retry-After']) > 0 && Number(busy.headers['Retry-After']) <= 30);

  const { rows: [{ n }] } = await pool.query('SELECT count(*)::int AS n FROM charges');
  assert.equal(n, 1, 'one charge for the key, whatever the retries');
  console.log('payment example: 201, replay, 422, 409 as documented');
} finally {
  await pool.end();
}
