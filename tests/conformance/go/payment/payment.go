// POST /charges with an Idempotency-Key, on database/sql and lib/pq: claim, then the business
// write and complete in one transaction, and the claim outcome mapped to an HTTP answer.
// (docs/other-languages.md shows this file; check.go beside it runs it.)
package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"

	"github.com/lib/pq"
)

type Answer struct {
	Status  int
	Headers map[string]string
	Body    json.RawMessage
}

func createCharge(ctx context.Context, db *sql.DB, account, key string,
	request map[string]any) (Answer, error) {
	requestJSON, err := json.Marshal(request)
	if err != nil {
		return Answer{}, err
	}
	// 1. Claim in its own transaction: db.QueryRowContext runs in autocommit.
	var outcome string
	var token sql.NullInt64
	var status, retryAfter sql.NullInt32
	var headersJSON, body []byte
	err = db.QueryRowContext(ctx, `SELECT outcome, lease_token, response_status,
	        response_headers, response_body, ceil(extract(epoch FROM retry_after))::int
	    FROM idempotency.claim(scope => $1, key => $2, request => $3::jsonb)`,
		account, key, string(requestJSON)).Scan(&outcome, &token, &status, &headersJSON,
		&body, &retryAfter)
	if err != nil {
		return Answer{}, err
	}
	switch outcome {
	case "claimed", "resumed":
		// Ours to run: new, or resumed after a crashed attempt. The charge below commits only
		// together with complete(), so a crashed attempt left nothing behind and running
		// again is safe.
	case "replay", "accepted": // the stored answer; the interim one (e.g. 202) of a running job
		headers := map[string]string{}
		if err := json.Unmarshal(headersJSON, &headers); err != nil {
			return Answer{}, err
		}
		headers["Idempotent-Replayed"] = "true"
		return Answer{int(status.Int32), headers, body}, nil
	case "in_progress":
		return Answer{409, map[string]string{"Retry-After": strconv.Itoa(int(retryAfter.Int32))},
			json.RawMessage(`{"error": "in_progress"}`)}, nil
	case "mismatch":
		return Answer{422, map[string]string{}, json.RawMessage(`{"error": "idempotency_key_reused"}`)}, nil
	case "expired": // only a tombstone is left (settings.tombstones): never run it again
		return Answer{422, map[string]string{}, json.RawMessage(`{"error": "idempotency_key_expired"}`)}, nil
	default: // an outcome this code does not know: never run the operation on a guess
		return Answer{}, fmt.Errorf("unknown claim outcome %q", outcome)
	}

	// 2. The business write and complete() in ONE transaction.
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return Answer{}, err
	}
	defer tx.Rollback() // a no-op after Commit
	var id int64
	if err = tx.QueryRowContext(ctx,
		"INSERT INTO charges (account, amount) VALUES ($1, $2) RETURNING id",
		account, request["amount"]).Scan(&id); err != nil {
		return Answer{}, err
	}
	answer := Answer{201, map[string]string{"Location": fmt.Sprintf("/charges/%d", id)},
		json.RawMessage(fmt.Sprintf(`{"id": %d, "amount": %v}`, id, request["amount"]))}
	headers, _ := json.Marshal(answer.Headers)
	_, err = tx.ExecContext(ctx, `SELECT idempotency.complete(scope => $1, key => $2,
	        lease_token => $3, status => $4, body => $5::jsonb, headers => $6::jsonb)`,
		account, key, token.Int64, answer.Status, string(answer.Body), string(headers))
	var pqErr *pq.Error
	if errors.As(err, &pqErr) && (pqErr.Code == "IK001" || pqErr.Code == "IK004") {
		// IK001: our lease was taken over (the key may be completed by now); IK004:
		// completed with our own token already. The charge rolls back (the defer); a retry
		// gets the stored answer.
		return Answer{409, map[string]string{"Retry-After": "1"},
			json.RawMessage(`{"error": "in_progress"}`)}, nil
	} else if err != nil {
		return Answer{}, err
	}
	return answer, tx.Commit()
}
