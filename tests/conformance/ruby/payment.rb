# frozen_string_literal: true

# POST /charges with an Idempotency-Key, on the pg gem: claim, then the business write and
# complete in one transaction, and the claim outcome mapped to an HTTP answer.
# (docs/other-languages.md shows this file; payment_check.rb runs it.)

require "json"
require "pg"

# conn = PG.connect(ENV.fetch("DATABASE_URL")); returns [status, headers, body].
def create_charge(conn, account, key, request)
  # 1. Claim in its own transaction: outside conn.transaction each statement autocommits.
  claim = conn.exec_params(<<~SQL, [account, key, JSON.generate(request)]).first
    SELECT outcome, lease_token, response_status, response_headers, response_body,
           ceil(extract(epoch FROM retry_after))::int AS retry_after
    FROM idempotency.claim(scope => $1, key => $2, request => $3::jsonb)
  SQL
  case claim["outcome"]
  when "claimed", "resumed"
    # Ours to run: new, or resumed after a crashed attempt. The charge below commits only
    # together with complete(), so a crashed attempt left nothing behind and running again
    # is safe.
  when "replay", "accepted" # the stored answer; the interim one (e.g. 202) of a running job
    return [claim["response_status"].to_i,
            JSON.parse(claim["response_headers"]).merge("Idempotent-Replayed" => "true"),
            JSON.parse(claim["response_body"])]
  when "in_progress" then return [409, { "Retry-After" => claim["retry_after"] }, { "error" => "in_progress" }]
  when "mismatch" then return [422, {}, { "error" => "idempotency_key_reused" }]
  # Only a tombstone is left (settings.tombstones): never run it again.
  when "expired" then return [422, {}, { "error" => "idempotency_key_expired" }]
  else raise "unknown claim outcome #{claim['outcome']}" # never run the operation on a guess
  end

  # 2. The business write and complete() in ONE transaction.
  conn.transaction do |tx|
    id = tx.exec_params("INSERT INTO charges (account, amount) VALUES ($1, $2) RETURNING id",
                        [account, request.fetch("amount")]).getvalue(0, 0).to_i
    headers = { "Location" => "/charges/#{id}" }
    body = { "id" => id, "amount" => request.fetch("amount") }
    tx.exec_params(<<~SQL, [account, key, claim["lease_token"], JSON.generate(body), JSON.generate(headers)])
      SELECT idempotency.complete(scope => $1, key => $2, lease_token => $3, status => 201,
                                  body => $4::jsonb, headers => $5::jsonb)
    SQL
    [201, headers, body]
  end
rescue PG::Error => e
  # transaction() rolled the charge back. IK001: our lease was taken over (the key may be
  # completed by now); IK004: completed with our own token already. A retry gets the stored
  # answer.
  raise unless %w[IK001 IK004].include?(e.result&.error_field(PG::PG_DIAG_SQLSTATE))

  [409, { "Retry-After" => "1" }, { "error" => "in_progress" }]
end
