// Runs payment.go (the Go example of docs/other-languages.md) against a database with the
// schema installed: check DSN. Exits non-zero when an answer is not the documented one.
package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"os"
	"reflect"
	"strconv"
)

// The same two statements in every language's check (payment_check.mjs, payment_check.rb,
// PaymentCheck.java). accepted: claim $1 and store a 202 on it, as a job's enqueuer would.
const accepted = `SELECT idempotency.accept(scope => 'acct_42', key => $1,
        lease_token => c.lease_token, status => 202, body => '{"status": "pending"}',
        headers => '{"Location": "/charges/pending"}')
    FROM idempotency.claim(scope => 'acct_42', key => $1, request => '{"amount": 8}') AS c`

// expire: key order-old completed three days ago (the schema owner's test clock);
// maintain() drops it and keeps a tombstone (a newer key keeps the newest partition).
const expire = `UPDATE idempotency.settings SET tombstones = true;
SELECT idempotency.complete(scope => 'acct_42', key => 'order-old', lease_token => c.lease_token,
                            status => 201, body => '{"id": 0}',
                            reference_time => now() - interval '3 days')
    FROM idempotency.claim(scope => 'acct_42', key => 'order-old', request => '{"amount": 9}',
                           reference_time => now() - interval '3 days') AS c;
SELECT idempotency.claim(scope => 'acct_42', key => 'order-later', request => '{}');
SELECT idempotency.maintain()`

func must(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
}

func expect(ok bool, what string, got any) {
	if !ok {
		fmt.Fprintf(os.Stderr, "%s: got %+v\n", what, got)
		os.Exit(1)
	}
}

func main() {
	db, err := sql.Open("postgres", os.Args[1]+"?sslmode=disable") // loopback, no TLS
	must(err)
	defer db.Close()
	ctx := context.Background()
	_, err = db.ExecContext(ctx, "DROP TABLE IF EXISTS charges")
	must(err)
	_, err = db.ExecContext(ctx, "CREATE TABLE charges (id bigserial PRIMARY KEY,"+
		" account text NOT NULL, amount integer NOT NULL)")
	must(err)
	key := fmt.Sprintf("order-%d", os.Getpid())

	first, err := createCharge(ctx, db, "acct_42", key, map[string]any{"amount": 50, "currency": "EUR"})
	must(err)
	expect(first.Status == 201 && first.Headers["Location"] != "", "first", first)

	again, err := createCharge(ctx, db, "acct_42", key, map[string]any{"currency": "EUR", "amount": 50})
	must(err)
	want := map[string]string{"Location": first.Headers["Location"], "Idempotent-Replayed": "true"}
	expect(again.Status == 201 && reflect.DeepEqual(again.Headers, want), "replay", again)
	// jsonb gives the stored body back normalised: compare as JSON text without spaces.
	var gotBody, firstBody any
	must(json.Unmarshal(again.Body, &gotBody))
	must(json.Unmarshal(first.Body, &firstBody))
	expect(reflect.DeepEqual(gotBody, firstBody), "replay body", string(again.Body))

	other, err := createCharge(ctx, db, "acct_42", key, map[string]any{"amount": 51, "currency": "EUR"})
	must(err)
	expect(other.Status == 422, "other request", other)

	// Another worker holds a live lease on a second key.
	_, err = db.ExecContext(ctx, `SELECT idempotency.claim('acct_42', $1, '{"amount": 7}')`, key+"-b")
	must(err)
	busy, err := createCharge(ctx, db, "acct_42", key+"-b", map[string]any{"amount": 7})
	must(err)
	retryAfter, err := strconv.Atoi(busy.Headers["Retry-After"])
	expect(busy.Status == 409 && err == nil && retryAfter > 0 && retryAfter <= 30, "busy", busy)

	// A job holds a third key and stored its interim answer with accept().
	_, err = db.ExecContext(ctx, accepted, key+"-c")
	must(err)
	interim, err := createCharge(ctx, db, "acct_42", key+"-c", map[string]any{"amount": 8})
	must(err)
	var interimBody any
	must(json.Unmarshal(interim.Body, &interimBody))
	expect(interim.Status == 202 && reflect.DeepEqual(interim.Headers, map[string]string{
		"Location": "/charges/pending", "Idempotent-Replayed": "true"}) &&
		reflect.DeepEqual(interimBody, map[string]any{"status": "pending"}), "accepted", interim)

	// With tombstones on, a key dropped after its retention is expired: refused, not run.
	_, err = db.ExecContext(ctx, expire)
	must(err)
	old, err := createCharge(ctx, db, "acct_42", "order-old", map[string]any{"amount": 9})
	must(err)
	expect(old.Status == 422 && string(old.Body) == `{"error": "idempotency_key_expired"}`,
		"expired", old)

	var n int
	must(db.QueryRowContext(ctx, "SELECT count(*) FROM charges").Scan(&n))
	expect(n == 1, "one charge for the key, whatever the retries", n)
	fmt.Println("payment example: 201, replay, 422, 409 as documented")
}
