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

check(conn.exec("SELECT count(*) FROM charges").getvalue(0, 0) == "1", "one charge for the key")
puts "payment example: 201, replay, 422, 409 as documented"
