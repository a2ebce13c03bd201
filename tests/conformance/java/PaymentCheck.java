// Runs Payment.java (the Java example of docs/other-languages.md) against a database with the
// schema installed: java PaymentCheck JDBC_URL. Exits non-zero when an answer is not the
// documented one.

import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.SQLException;
import java.sql.Statement;

public final class PaymentCheck {
    // The same two statements in every language's check (payment_check.mjs, payment_check.rb,
    // check.go). ACCEPTED: claim a key (both ? are the key) and store a 202 on it, as a job's
    // enqueuer would.
    static final String ACCEPTED = """
            SELECT idempotency.accept(scope => 'acct_42', key => ?, lease_token => c.lease_token,
                                      status => 202, body => '{"status": "pending"}',
                                      headers => '{"Location": "/charges/pending"}')
            FROM idempotency.claim(scope => 'acct_42', key => ?, request => '{"amount": 8}') AS c
            """;
    // EXPIRE: key order-old completed three days ago (the schema owner's test clock);
    // maintain() drops it and keeps a tombstone (a newer key keeps the newest partition).
    static final String EXPIRE = """
            UPDATE idempotency.settings SET tombstones = true;
            SELECT idempotency.complete(scope => 'acct_42', key => 'order-old',
                                        lease_token => c.lease_token, status => 201, body => '{"id": 0}',
                                        reference_time => now() - interval '3 days')
            FROM idempotency.claim(scope => 'acct_42', key => 'order-old', request => '{"amount": 9}',
                                   reference_time => now() - interval '3 days') AS c;
            SELECT idempotency.claim(scope => 'acct_42', key => 'order-later', request => '{}');
            SELECT idempotency.maintain()
            """;

    static void check(boolean ok, Object what) {
        if (!ok) {
            System.err.println("not as documented: " + what);
            System.exit(1);
        }
    }

    static String compact(String json) {
        return json.replace(" ", "");
    }

    public static void main(String[] args) throws SQLException {
        try (Connection conn = DriverManager.getConnection(args[0]);
                Statement st = conn.createStatement()) {
            st.execute("DROP TABLE IF EXISTS charges");
            st.execute("CREATE TABLE charges (id bigserial PRIMARY KEY, account text NOT NULL,"
                    + " amount integer NOT NULL)");
            String key = "order-" + ProcessHandle.current().pid();

            Payment.Answer first = Payment.createCharge(conn, "acct_42", key, 50,
                    "{\"amount\": 50, \"currency\": \"EUR\"}");
            check(first.status() == 201, first);

            Payment.Answer again = Payment.createCharge(conn, "acct_42", key, 50,
                    "{\"currency\": \"EUR\", \"amount\": 50}");
            // jsonb stores the body normalised (keys sorted by length, then bytes): "amount"
            // sorts after "id" either way, so only spaces differ.
            check(again.status() == 201 && compact(again.body()).equals(compact(first.body()))
                    && compact(again.headersJson()).equals(compact(first.headersJson())), again);

            Payment.Answer other = Payment.createCharge(conn, "acct_42", key, 51,
                    "{\"amount\": 51, \"currency\": \"EUR\"}");
            check(other.status() == 422, other);

            // Another worker holds a live lease on a second key.
            st.execute("SELECT idempotency.claim('acct_42', '" + key + "-b', '{\"amount\": 7}')");
            Payment.Answer busy = Payment.createCharge(conn, "acct_42", key + "-b", 7,
                    "{\"amount\": 7}");
            int retryAfter = Integer.parseInt(busy.headersJson().replaceAll("\\D", ""));
            check(busy.status() == 409 && retryAfter > 0 && retryAfter <= 30, busy);

            // A job holds a third key and stored its interim answer with accept().
            try (PreparedStatement ps = conn.prepareStatement(ACCEPTED)) {
                ps.setString(1, key + "-c");
                ps.setString(2, key + "-c");
                ps.execute();
            }
            Payment.Answer accepted = Payment.createCharge(conn, "acct_42", key + "-c", 8,
                    "{\"amount\": 8}");
            check(accepted.status() == 202
                    && compact(accepted.headersJson()).equals("{\"Location\":\"/charges/pending\"}")
                    && compact(accepted.body()).equals("{\"status\":\"pending\"}"), accepted);

            // With tombstones on, a key dropped after its retention is expired: refused, not run.
            st.execute(EXPIRE);
            Payment.Answer expired = Payment.createCharge(conn, "acct_42", "order-old", 9,
                    "{\"amount\": 9}");
            check(expired.status() == 422
                    && expired.body().equals("{\"error\": \"idempotency_key_expired\"}"), expired);

            try (ResultSet rs = st.executeQuery("SELECT count(*) FROM charges")) {
                rs.next();
                check(rs.getInt(1) == 1, "one charge for the key, whatever the retries");
            }
            System.out.println("payment example: 201, replay, 422, 409 as documented");
        }
    }

    private PaymentCheck() {}
}
