// Runs payment.mjs (the Node example of docs/other-languages.md) against a database with the
// schema installed: node payment_check.mjs DSN. Exits non-zero when an answer is not the
// documented one.
import assert from 'node:assert/strict';
import pg from 'pg';
import { createCharge } from './payment.mjs';

// The same two statements in every language's check (payment_check.rb, check.go,
// PaymentCheck.java). ACCEPTED: claim $1 and store a 202 on it, as a job's enqueuer would.
const ACCEPTED = `SELECT idempotency.accept(scope => 'acct_42', key => $1, lease_token => c.lease_token,
                         status => 202, body => '{"status": "pending"}',
                         headers => '{"Location": "/charges/pending"}')
  FROM idempotency.claim(scope => 'acct_42', key => $1, request => '{"amount": 8}') AS c`;
// EXPIRE: key order-old completed three days ago (the schema owner's test clock);
// maintain() drops it and keeps a tombstone (a newer key keeps the newest partition).
const EXPIRE = `UPDATE idempotency.settings SET tombstones = true;
SELECT idempotency.complete(scope => 'acct_42', key => 'order-old', lease_token => c.lease_token,
                            status => 201, body => '{"id": 0}',
                            reference_time => now() - interval '3 days')
  FROM idempotency.claim(scope => 'acct_42', key => 'order-old', request => '{"amount": 9}',
                           reference_time => now() - interval '3 days') AS c;
SELECT idempotency.claim(scope => 'acct_42', key => 'order-later', request => '{}');
SELECT idempotency.maintain()`;

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

  // A job holds a third key and stored its interim answer with accept().
  await pool.query(ACCEPTED, [`${key}-c`]);
  const accepted = await createCharge(pool, 'acct_42', `${key}-c`, { amount: 8 });
  assert.deepEqual(accepted, {
    status: 202,
    headers: { Location: '/charges/pending', 'Idempotent-Replayed': 'true' },
    body: { status: 'pending' },
  });

  // With tombstones on, a key dropped after its retention is expired: refused, not run.
  await pool.query(EXPIRE);
  const expired = await createCharge(pool, 'acct_42', 'order-old', { amount: 9 });
  assert.deepEqual(expired, { status: 422, headers: {}, body: { error: 'idempotency_key_expired' } });

  const { rows: [{ n }] } = await pool.query('SELECT count(*)::int AS n FROM charges');
  assert.equal(n, 1, 'one charge for the key, whatever the retries');
  console.log('payment example: 201, replay, 422, 409 as documented');
} finally {
  await pool.end();
}
