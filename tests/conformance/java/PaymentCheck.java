// Runs Payment.java (the Java example of docs/other-languages.md) against a database with the
// schema installed: java PaymentCheck JDBC_URL. Exits non-zero when an answer is not the
// documented one.

import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.ResultSet;
import java.sql.SQLException;
import java.sql.Statement;

public final class PaymentCheck {
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

            try (ResultSet rs = st.executeQuery("SELECT count(*) FROM charges")) {
                rs.next();
                check(rs.getInt(1) == 1, "one charge for the key, whatever the retries");
            }
            System.out.println("payment example: 201, replay, 422, 409 as documented");
        }
    }

    private PaymentCheck() {}
}
