# frozen_string_literal: true

# Runs payment.rb (the Ruby example of docs/other-languages.md) against a database with the
# schema installed: ruby payment_check.rb DSN. Exits non-zero when an answer is not the
# documented one.

require_relative "payment"

def check(ok, what)
  return if ok

  warn "not as documented: #{what}"
  exit 1
end

# The same two statements in every language's check (payment_check.mjs, check.go,
# PaymentCheck.java). ACCEPTED: claim $1 and store a 202 on it, as a job's enqueuer would.
ACCEPTED = <<~SQL
  SELECT idempotency.accept(scope => 'acct_42', key => $1, lease_token => c.lease_token,
                            status => 202, body => '{"status": "pending"}',
                            headers => '{"Location": "/charges/pending"}')
  FROM idempotency.claim(scope => 'acct_42', key => $1, request => '{"amount": 8}') AS c
SQL
# EXPIRE: key order-old completed three days ago (the schema owner's test clock);
# maintain() drops it and keeps a tombstone (a newer key keeps the newest partition).
EXPIRE = <<~SQL
  UPDATE idempotency.settings SET tombstones = true;
  SELECT idempotency.complete(scope => 'acct_42', key => 'order-old', lease_token => c.lease_token,
                              status => 201, body => '{"id": 0}',
                            reference_time => now() - interval '3 days')
  FROM idempotency.claim(scope => 'acct_42', key => 'order-old', request => '{"amount": 9}',
                           reference_time => now() - interval '3 days') AS c;
  SELECT idempotency.claim(scope => 'acct_42', key => 'order-later', request => '{}');
  SELECT idempotency.maintain()
SQL

conn = PG.connect(ARGV.fetch(0))
conn.exec("DROP TABLE IF EXISTS charges")
conn.exec("CREATE TABLE charges (id bigserial PRIMARY KEY, account text NOT NULL, amount integer NOT NULL)")
key = "order-#{Process.pid}"

first = create_charge(conn, "acct_42", key, { "amount" => 50, "currency" => "EUR" })
check(first[0] == 201 && first[2]["amount"] == 50, "first #{first}")

again = create_charge(conn, "acct_42", key, { "currency" => "EUR", "amount" => 50 })
check(again == [201, first[1].merge("Idempotent-Replayed" => "true"), first[2]], "replay #{again}")

other = create_charge(conn, "acct_42", key, { "amount" => 51, "currency" => "EUR" })
check(other[0] == 422, "other request #{other}")

# Another worker holds a live lease on a second key.
conn.exec_params("SELECT idempotency.claim('acct_42', $1, '{\"amount\": 7}')", ["#{key}-b"])
busy = create_charge(conn, "acct_42", "#{key}-b", { "amount" => 7 })
check(busy[0] == 409 && (1..30).cover?(Integer(busy[1]["Retry-After"])), "busy #{busy}")

# A job holds a third key and stored its interim answer with accept().
conn.exec_params(ACCEPTED, ["#{key}-c"])
accepted = create_charge(conn, "acct_42", "#{key}-c", { "amount" => 8 })
check(accepted == [202, { "Location" => "/charges/pending", "Idempotent-Replayed" => "true" },
                   { "status" => "pending" }], "accepted #{accepted}")

# With tombstones on, a key dropped after its retention is expired: refused, not run.
conn.exec(EXPIRE)
expired = create_charge(conn, "acct_42", "order-old", { "amount" => 9 })
check(expired == [422, {}, { "error" => "idempotency_key_expired" }], "expired #{expired}")

check(conn.exec("SELECT count(*) FROM charges").getvalue(0, 0) == "1", "one charge for the key")
puts "payment example: 201, replay, 422, 409 as documented"
