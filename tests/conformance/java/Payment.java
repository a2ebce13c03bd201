// POST /charges with an Idempotency-Key, on JDBC (pgJDBC): claim, then the business write and
// complete in one transaction, and the claim outcome mapped to an HTTP answer.
// (docs/other-languages.md shows this file; PaymentCheck.java runs it.)

import java.sql.Connection;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.SQLException;

public final class Payment {
    /** headersJson and body: JSON text, as the database stores them. */
    public record Answer(int status, String headersJson, String body) {}

    public static Answer createCharge(Connection conn, String account, String key, int amount,
            String requestJson) throws SQLException {
        String outcome;
        String storedHeaders;
        String storedBody;
        long token;
        int storedStatus;
        int retryAfter;
        // 1. Claim in its own transaction: with autocommit on, the claim commits at once.
        conn.setAutoCommit(true);
        try (PreparedStatement ps = conn.prepareStatement(
                "SELECT outcome, lease_token, response_status, response_headers::text, "
                + "response_body::text, ceil(extract(epoch FROM retry_after))::int "
                + "FROM idempotency.claim(scope => ?, key => ?, request => ?::jsonb)")) {
            ps.setString(1, account);
            ps.setString(2, key);
            ps.setString(3, requestJson);
            try (ResultSet rs = ps.executeQuery()) {
                rs.next();
                outcome = rs.getString(1);
                token = rs.getLong(2);
                storedStatus = rs.getInt(3);
                storedHeaders = rs.getString(4);
                storedBody = rs.getString(5);
                retryAfter = rs.getInt(6);
            }
        }
        switch (outcome) {
            case "claimed", "resumed":
                // Ours to run: new, or resumed after a crashed attempt. The charge below
                // commits only together with complete(), so a crashed attempt left nothing
                // behind.
                break;
            case "replay", "accepted":  // the stored answer; the interim one (e.g. 202) of a
                // running job. Send storedHeaders plus Idempotent-Replayed: true.
                return new Answer(storedStatus, storedHeaders, storedBody);
            case "in_progress":
                return new Answer(409, "{\"Retry-After\": \"" + retryAfter + "\"}",
                        "{\"error\": \"in_progress\"}");
            case "mismatch":
                return new Answer(422, "{}", "{\"error\": \"idempotency_key_reused\"}");
            case "expired":  // only a tombstone is left (settings.tombstones): never run it again
                return new Answer(422, "{}", "{\"error\": \"idempotency_key_expired\"}");
            default:  // an outcome this code does not know: never run the operation on a guess
                throw new IllegalStateException("unknown claim outcome " + outcome);
        }
        // 2. The business write and complete() in ONE transaction.
        conn.setAutoCommit(false);
        try {
            long id;
            try (PreparedStatement ins = conn.prepareStatement(
                    "INSERT INTO charges (account, amount) VALUES (?, ?) RETURNING id")) {
                ins.setString(1, account);
                ins.setInt(2, amount);
                try (ResultSet rs = ins.executeQuery()) {
                    rs.next();
                    id = rs.getLong(1);
                }
            }
            String body = "{\"id\": " + id + ", \"amount\": " + amount + "}";
            String headers = "{\"Location\": \"/charges/" + id + "\"}";
            try (PreparedStatement done = conn.prepareStatement(
                    "SELECT idempotency.complete(scope => ?, key => ?, lease_token => ?, "
                    + "status => 201, body => ?::jsonb, headers => ?::jsonb)")) {
                done.setString(1, account);
                done.setString(2, key);
                done.setLong(3, token);
                done.setString(4, body);
                done.setString(5, headers);
                done.executeQuery().close();
            }
            conn.commit();
            return new Answer(201, headers, body);
        } catch (SQLException e) {
            conn.rollback();
            // IK001: our lease was taken over (the key may be completed by now); IK004:
            // completed with our own token already. The charge rolled back; a retry gets the
            // stored answer. (For argument errors,
            // ((PSQLException) e).getServerErrorMessage().getColumn() names the argument.)
            if ("IK001".equals(e.getSQLState()) || "IK004".equals(e.getSQLState())) {
                return new Answer(409, "{\"Retry-After\": \"1\"}", "{\"error\": \"in_progress\"}");
            }
            throw e;
        } finally {
            conn.setAutoCommit(true);
        }
    }

    private Payment() {}
}
