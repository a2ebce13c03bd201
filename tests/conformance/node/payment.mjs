// POST /charges with an Idempotency-Key, on node-postgres: claim, then the business write and
// complete in one transaction, and the claim outcome mapped to an HTTP answer.
// (docs/other-languages.md shows this file; tests/conformance/node/payment_check.mjs runs it.)

export async function createCharge(pool, account, idempotencyKey, request) {
  // 1. Claim in its own transaction: pool.query runs one statement in autocommit.
  const { rows: [claim] } = await pool.query(
    `SELECT outcome, lease_token, response_status, response_headers, response_body,
            ceil(extract(epoch FROM retry_after))::int AS retry_after_s
       FROM idempotency.claim(scope => $1, key => $2, request => $3::jsonb)`,
    [account, idempotencyKey, JSON.stringify(request)]);

  switch (claim.outcome) {
    case 'claimed':
    case 'resumed':
      // Ours to run: new, or resumed after a crashed attempt. The charge below commits only
      // together with complete(), so a crashed attempt left nothing behind and running again
      // is safe. (Side effects outside this database: reconcile from claim.recovery_point first.)
      break;
    case 'replay': // the stored answer
    case 'accepted': // the interim answer (e.g. 202) of a job still running
      return {
        status: claim.response_status,
        headers: { ...claim.response_headers, 'Idempotent-Replayed': 'true' },
        body: claim.response_body,
      };
    case 'in_progress':
      return { status: 409, headers: { 'Retry-After': String(claim.retry_after_s) }, body: { error: 'in_progress' } };
    case 'mismatch':
      return { status: 422, headers: {}, body: { error: 'idempotency_key_reused' } };
    case 'expired': // only a tombstone is left (settings.tombstones): never run it again
      return { status: 422, headers: {}, body: { error: 'idempotency_key_expired' } };
    default: // an outcome this code does not know: never run the operation on a guess
      throw new Error(`unknown claim outcome ${claim.outcome}`);
  }

  // 2. The business write and complete() in ONE transaction, on one client.
  const client = await pool.connect();
  try {
    await client.query('BEGIN');
    const { rows: [charge] } = await client.query(
      'INSERT INTO charges (account, amount) VALUES ($1, $2) RETURNING id',
      [account, request.amount]);
    const response = {
      status: 201,
      headers: { Location: `/charges/${charge.id}` },
      body: { id: Number(charge.id), amount: request.amount },
    };
    await client.query(
      `SELECT idempotency.complete(scope => $1, key => $2, lease_token => $3, status => $4,
                                   body => $5::jsonb, headers => $6::jsonb)`,
      [account, idempotencyKey, claim.lease_token, response.status,
       JSON.stringify(response.body), JSON.stringify(response.headers)]);
    await client.query('COMMIT');
    return response;
  } catch (err) {
    await client.query('ROLLBACK');
    // IK001: our lease was taken over (the key may be completed by now); IK004: completed
    // with our own token already. The charge rolled back; a retry gets the stored answer.
    if (err.code === 'IK001' || err.code === 'IK004') {
      return { status: 409, headers: { 'Retry-After': '1' }, body: { error: 'in_progress' } };
    }
    throw err;
  } finally {
    client.release();
  }
}
