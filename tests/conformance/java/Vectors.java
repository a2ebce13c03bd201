// The fingerprint vectors (tests/vectors/fingerprint.json) from Java: for each one, SHA-256 of
// the canonical text computed here, idempotency.fingerprint and canonical_json from the
// database, and derive_key, must all give the committed values. JSON is read with Run.Json.
//
//   java -cp CLASSES:/usr/share/java/postgresql.jar Vectors VECTORS.json DSN
//   (prints a count line; exit 1 on a mismatch)

import java.math.BigInteger;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.security.MessageDigest;
import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.SQLException;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;

public final class Vectors {
    static String one(Connection conn, String sql, String... params) throws SQLException {
        try (PreparedStatement ps = conn.prepareStatement(sql)) {
            for (int k = 0; k < params.length; k++) {
                ps.setString(k + 1, params[k]);
            }
            try (ResultSet rs = ps.executeQuery()) {
                rs.next();
                return rs.getString(1);
            }
        }
    }

    public static void main(String[] args) throws Exception {
        Map<String, Object> vectors = Run.obj(Run.Json.parse(
                Files.readString(Path.of(args[0]), StandardCharsets.UTF_8)));
        List<String> failures = new ArrayList<>();
        List<Object> fingerprints = Run.list(vectors.get("fingerprint"));
        List<Object> derived = Run.list(vectors.get("derive_key"));
        try (Connection conn = DriverManager.getConnection(Run.jdbcUrl(args[1]))) {
            for (Object o : fingerprints) {
                Map<String, Object> v = Run.obj(o);
                String name = (String) v.get("name");
                String want = (String) v.get("sha256_hex");
                byte[] sum = MessageDigest.getInstance("SHA-256").digest(
                        ((String) v.get("canonical")).getBytes(StandardCharsets.UTF_8));
                String local = String.format("%064x", new BigInteger(1, sum));
                if (!local.equals(want)) {
                    failures.add(name + ": sha256 here " + local);
                }
                String fields = v.containsKey("fields") ? Run.Json.write(v.get("fields")) : null;
                String digest = one(conn, "SELECT encode(idempotency.fingerprint(request => ?::jsonb,"
                        + " defaults => coalesce(?::jsonb, '{}'), fields => (SELECT CASE WHEN f IS NOT NULL"
                        + " THEN ARRAY(SELECT jsonb_array_elements_text(f)) END FROM (SELECT ?::jsonb AS f)"
                        + " AS a)), 'hex')",
                        (String) v.get("request"), (String) v.get("defaults"), fields);
                if (!want.equals(digest)) {
                    failures.add(name + ": fingerprint " + digest);
                }
                if (v.containsKey("defaults") || v.containsKey("fields")) {
                    continue;
                }
                String canonical = one(conn, "SELECT idempotency.canonical_json(?::jsonb)",
                        (String) v.get("request"));
                if (!v.get("canonical").equals(canonical)) {
                    failures.add(name + ": canonical_json " + canonical);
                }
            }
            for (Object o : derived) {
                Map<String, Object> v = Run.obj(o);
                String got = one(conn, "SELECT idempotency.derive_key(scope => ?, key => ?, step => ?)",
                        (String) v.get("scope"), (String) v.get("key"), (String) v.get("step"));
                if (!v.get("derived").equals(got)) {
                    failures.add(v.get("name") + ": derive_key " + got);
                }
            }
        }
        failures.forEach(System.err::println);
        System.out.println("vectors: " + fingerprints.size() + " fingerprint, " + derived.size()
                + " derive_key, " + failures.size() + " failed");
        System.exit(failures.isEmpty() ? 0 : 1);
    }

    private Vectors() {}
}
