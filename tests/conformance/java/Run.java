// Runner 5: Java with JDBC (Debian's pgJDBC, libpostgresql-jdbc-java) and nothing of ours: it
// reads the scenario files and calls the idempotency.* SQL functions by name, one connection
// a session. The JDK has no JSON library, so Json below reads and writes it (about 120 lines).
//
//   java -cp CLASSES:/usr/share/java/postgresql.jar Run FUNCTIONS.json DSN SCENARIO.json...
//
// DSN is a libpq URI (postgresql://user@host:port/db). Prints one JSON line a scenario:
// {"file", "name", "failures": [...], "steps", "checks"} (the steps it ran and the comparisons
// it made, which the tests compare with the scenario's, so that a skipped step or check
// fails); exits 0 when every scenario passed, 1 when one failed, 2 on a usage or connection
// error. Arguments are bound and results read as functions.json
// says, the same way as the other runners (tests/conformance/README.md).

import java.io.IOException;
import java.math.BigDecimal;
import java.net.URI;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.ResultSetMetaData;
import java.sql.SQLException;
import java.sql.Statement;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Objects;
import java.util.regex.Matcher;
import java.util.regex.Pattern;
import org.postgresql.util.PSQLException;
import org.postgresql.util.ServerErrorMessage;

public final class Run {
    /** JSON as Map (insertion order), List, String, BigDecimal (exact), Boolean and null. */
    static final class Json {
        private final String s;
        private int i;

        private Json(String s) {
            this.s = s;
        }

        static Object parse(String text) {
            Json p = new Json(text);
            Object v = p.value();
            p.ws();
            if (p.i != p.s.length()) {
                throw p.error("trailing text");
            }
            return v;
        }

        private IllegalArgumentException error(String what) {
            return new IllegalArgumentException("JSON: " + what + " at " + i);
        }

        private void ws() {
            while (i < s.length() && " \t\r\n".indexOf(s.charAt(i)) >= 0) {
                i++;
            }
        }

        private boolean eat(String word) {
            if (s.startsWith(word, i)) {
                i += word.length();
                return true;
            }
            return false;
        }

        private Object value() {
            ws();
            if (i >= s.length()) {
                throw error("unexpected end");
            }
            char c = s.charAt(i);
            if (c == '{') {
                i++;
                Map<String, Object> m = new LinkedHashMap<>();
                ws();
                if (eat("}")) {
                    return m;
                }
                do {
                    ws();
                    String k = string();
                    ws();
                    if (!eat(":")) {
                        throw error("expected :");
                    }
                    m.put(k, value());
                    ws();
                } while (eat(","));
                if (!eat("}")) {
                    throw error("expected }");
                }
                return m;
            }
            if (c == '[') {
                i++;
                List<Object> l = new ArrayList<>();
                ws();
                if (eat("]")) {
                    return l;
                }
                do {
                    l.add(value());
                    ws();
                } while (eat(","));
                if (!eat("]")) {
                    throw error("expected ]");
                }
                return l;
            }
            if (c == '"') {
                return string();
            }
            if (eat("true")) {
                return Boolean.TRUE;
            }
            if (eat("false")) {
                return Boolean.FALSE;
            }
            if (eat("null")) {
                return null;
            }
            int start = i;
            while (i < s.length() && "+-0123456789.eE".indexOf(s.charAt(i)) >= 0) {
                i++;
            }
            if (start == i) {
                throw error("unexpected character");
            }
            return new BigDecimal(s.substring(start, i));
        }

        private String string() {
            if (!eat("\"")) {
                throw error("expected a string");
            }
            StringBuilder b = new StringBuilder();
            while (true) {
                if (i >= s.length()) {
                    throw error("unterminated string");
                }
                char c = s.charAt(i++);
                if (c == '"') {
                    return b.toString();
                }
                if (c != '\\') {
                    b.append(c);
                    continue;
                }
                char e = s.charAt(i++);
                switch (e) {
                    case 'n' -> b.append('\n');
                    case 't' -> b.append('\t');
                    case 'r' -> b.append('\r');
                    case 'b' -> b.append('\b');
                    case 'f' -> b.append('\f');
                    case 'u' -> {
                        b.append((char) Integer.parseInt(s.substring(i, i + 4), 16));
                        i += 4;
                    }
                    default -> b.append(e);
                }
            }
        }

        /** Compact JSON; numbers keep their spelling (a scenario's 10.0 is sent as 10.0). */
        static String write(Object v) {
            StringBuilder b = new StringBuilder();
            write(b, v);
            return b.toString();
        }

        private static void write(StringBuilder b, Object v) {
            if (v == null) {
                b.append("null");
            } else if (v instanceof String str) {
                b.append('"');
                for (char c : str.toCharArray()) {
                    switch (c) {
                        case '"' -> b.append("\\\"");
                        case '\\' -> b.append("\\\\");
                        case '\n' -> b.append("\\n");
                        case '\r' -> b.append("\\r");
                        case '\t' -> b.append("\\t");
                        default -> {
                            if (c < 0x20) {
                                b.append(String.format("\\u%04x", (int) c));
                            } else {
                                b.append(c);
                            }
                        }
                    }
                }
                b.append('"');
            } else if (v instanceof Map<?, ?> m) {
                b.append('{');
                boolean first = true;
                for (Map.Entry<?, ?> e : m.entrySet()) {
                    if (!first) {
                        b.append(',');
                    }
                    first = false;
                    write(b, e.getKey());
                    b.append(':');
                    write(b, e.getValue());
                }
                b.append('}');
            } else if (v instanceof List<?> l) {
                b.append('[');
                for (int k = 0; k < l.size(); k++) {
                    if (k > 0) {
                        b.append(',');
                    }
                    write(b, l.get(k));
                }
                b.append(']');
            } else if (v instanceof BigDecimal d) {
                b.append(d.toString());
            } else {
                b.append(v.toString());
            }
        }

        /** JSON equality as jsonb has it: numbers by value, booleans apart from numbers. */
        static boolean equal(Object a, Object b) {
            if (a instanceof BigDecimal x && b instanceof BigDecimal y) {
                return x.compareTo(y) == 0;
            }
            if (a instanceof Map<?, ?> x && b instanceof Map<?, ?> y) {
                if (!x.keySet().equals(y.keySet())) {
                    return false;
                }
                for (Object k : x.keySet()) {
                    if (!equal(x.get(k), y.get(k))) {
                        return false;
                    }
                }
                return true;
            }
            if (a instanceof List<?> x && b instanceof List<?> y) {
                if (x.size() != y.size()) {
                    return false;
                }
                for (int k = 0; k < x.size(); k++) {
                    if (!equal(x.get(k), y.get(k))) {
                        return false;
                    }
                }
                return true;
            }
            return Objects.equals(a, b);
        }
    }

    record Call(String sql, List<String> params, Map<String, String> columns, String shape) {}

    /** What runScenario found, and how much of the scenario it ran. */
    record Outcome(List<String> failures, int steps, int checks) {}

    private static final Pattern PLACEHOLDER = Pattern.compile("\\{(\\w+)\\}");

    private final Map<String, Object> api;

    Run(Map<String, Object> api) {
        this.api = api;
    }

    @SuppressWarnings("unchecked")
    static Map<String, Object> obj(Object o) {
        return (Map<String, Object>) o;
    }

    @SuppressWarnings("unchecked")
    static List<Object> list(Object o) {
        return (List<Object>) o;
    }

    /** {name} replaced by values[name]; unknown names stay (like run.mjs). */
    static String fill(String template, Map<String, String> values) {
        Matcher m = PLACEHOLDER.matcher(template);
        StringBuilder b = new StringBuilder();
        while (m.find()) {
            String v = values.get(m.group(1));
            m.appendReplacement(b, Matcher.quoteReplacement(v != null ? v : m.group()));
        }
        m.appendTail(b);
        return b.toString();
    }

    static String kindOf(String sqlType) {
        return switch (sqlType) {
            case "integer" -> "int";
            case "bigint" -> "bigint";
            case "timestamptz", "interval" -> "float";
            case "boolean" -> "bool";
            case "jsonb" -> "json";
            default -> "text";
        };
    }

    /** A scenario argument as the text every runner sends (null for SQL NULL). */
    static String argText(String sqlType, Object value) {
        if (value == null) {
            return null;
        }
        if ((sqlType.equals("jsonb") && !(value instanceof String)) || sqlType.equals("text[]")) {
            return Json.write(value);
        }
        return value.toString();
    }

    private String template(String section, String key) {
        Map<String, Object> m = obj(api.get(section));
        return (String) (m.containsKey(key) ? m.get(key) : m.get("*"));
    }

    private String project(String sqlType, String expr) {
        return fill(template("project", sqlType), Map.of("v", expr));
    }

    Call buildCall(Map<String, Object> step, String clock, BigDecimal at, Map<String, String> refs) {
        String name = (String) step.get("call");
        Map<String, Object> fn = obj(obj(api.get("functions")).get(name));
        Map<String, Object> given = step.containsKey("args") ? obj(step.get("args")) : Map.of();
        List<String> params = new ArrayList<>();
        List<String> parts = new ArrayList<>();
        for (Object a : list(fn.get("args"))) {
            String arg = (String) list(a).get(0);
            String sqlType = (String) list(a).get(1);
            if (arg.equals("reference_time") && clock.equals("virtual")) {
                String atText = at.stripTrailingZeros().scale() <= 0
                        ? at.toBigInteger().toString() : at.stripTrailingZeros().toPlainString();
                parts.add("reference_time => " + fill(
                        (String) obj(api.get("clock")).get("reference_time"), Map.of("at", atText)));
                continue;
            }
            if (!given.containsKey(arg)) {
                continue;
            }
            Object value = given.get(arg);
            String text = value instanceof Map<?, ?> m && m.containsKey("$ref")
                    ? refs.get((String) m.get("$ref")) : argText(sqlType, value);
            // JDBC placeholders are ?, bound in order: a template using {p} twice (text[])
            // binds the value twice.
            String bind = template("bind", sqlType);
            for (int n = bind.split("\\{p\\}", -1).length - 1; n > 0; n--) {
                params.add(text);
            }
            parts.add(arg + " => " + fill(bind, Map.of("p", "?", "type", sqlType)));
        }
        String call = "idempotency." + name + "(" + String.join(", ", parts) + ")";
        String returns = (String) fn.get("returns");
        if (returns.equals("void")) {
            return new Call("SELECT (" + call + ") IS NULL AS value", params, Map.of(), "void");
        }
        boolean setof = returns.startsWith("setof ");
        String typeName = setof ? returns.substring(6) : returns;
        Map<String, Object> types = obj(api.get("types"));
        if (types.containsKey(typeName)) {
            List<String> proj = new ArrayList<>();
            Map<String, String> columns = new LinkedHashMap<>();
            for (Object c : list(types.get(typeName))) {
                String col = (String) list(c).get(0);
                String t = (String) list(c).get(1);
                proj.add(project(t, "r." + col) + " AS " + col);
                columns.put(col, kindOf(t));
            }
            String select = "SELECT " + String.join(", ", proj) + " FROM " + call;
            return setof
                    ? new Call(select + " WITH ORDINALITY AS r ORDER BY r.ordinality", params, columns, "rows")
                    : new Call(select + " AS r", params, columns, "row");
        }
        return new Call("SELECT " + project(returns, call) + " AS value", params,
                Map.of("value", kindOf(returns)), "value");
    }

    /** A projected column (read as text) as its kind says. */
    static Object value(String kind, String text) {
        if (text == null) {
            return null;
        }
        return switch (kind) {
            case "int", "bigint", "float" -> new BigDecimal(text);
            case "bool" -> text.equals("t") || text.equals("true");
            case "json" -> Json.parse(text);
            default -> text;
        };
    }

    static boolean isMatcher(Object v) {
        if (!(v instanceof Map<?, ?> m)) {
            return false;
        }
        for (Object k : m.keySet()) {
            if (((String) k).startsWith("$")) {
                return true;
            }
        }
        return false;
    }

    /** Same checks, in the same order, as matcher_checks() in tests/conformance/__init__.py. */
    static List<Object[]> matcherChecks(Object m) {
        List<Object[]> checks = new ArrayList<>();
        if (!isMatcher(m)) {
            checks.add(m == null ? new Object[] {"is_null", false, null} : new Object[] {"eq", false, m});
            return checks;
        }
        Map<String, Object> mm = obj(m);
        if (mm.containsKey("$not_null") || mm.containsKey("$capture")) {
            checks.add(new Object[] {"not_null", false, null});
        }
        for (String op : new String[] {"$eq", "$ne", "$gt", "$lt"}) {
            if (mm.containsKey(op)) {
                checks.add(new Object[] {op.substring(1), mm.get(op) instanceof String, mm.get(op)});
            }
        }
        return checks;
    }

    static boolean compare(String op, Object got, Object want) {
        switch (op) {
            case "eq":
                return Json.equal(got, want);
            case "ne":
                return !Json.equal(got, want);
            default:
                if (!(got instanceof BigDecimal g) || !(want instanceof BigDecimal w)) {
                    return false;
                }
                return op.equals("gt") ? g.compareTo(w) > 0 : g.compareTo(w) < 0;
        }
    }

    static String show(Object v) {
        return Json.write(v);
    }

    /** A libpq URI (postgresql://user@host:port/db) as a JDBC URL. */
    static String jdbcUrl(String dsn) {
        URI u = URI.create(dsn);
        String url = "jdbc:postgresql://" + u.getHost() + (u.getPort() > 0 ? ":" + u.getPort() : "")
                + u.getRawPath();
        String query = u.getRawQuery() != null ? u.getRawQuery() : "";
        if (u.getRawUserInfo() != null) {
            String[] ui = u.getRawUserInfo().split(":", 2);
            query += (query.isEmpty() ? "" : "&") + "user=" + ui[0]
                    + (ui.length > 1 ? "&password=" + ui[1] : "");
        }
        return query.isEmpty() ? url : url + "?" + query;
    }

    /** Every column as text (pgJDBC's getString), NULL as null. */
    static List<Map<String, String>> rows(ResultSet rs) throws SQLException {
        ResultSetMetaData md = rs.getMetaData();
        List<Map<String, String>> out = new ArrayList<>();
        while (rs.next()) {
            Map<String, String> r = new HashMap<>();
            for (int c = 1; c <= md.getColumnCount(); c++) {
                r.put(md.getColumnLabel(c), rs.getString(c));
            }
            out.add(r);
        }
        return out;
    }

    Outcome runScenario(String url, Map<String, Object> scenario) throws SQLException {
        List<String> failures = new ArrayList<>();
        int ran = 0;
        int checks = 0;
        Map<String, Object> captures = new HashMap<>();
        Map<String, String> refs = new HashMap<>();
        Map<String, Connection> conns = new HashMap<>();
        String clock = scenario.containsKey("clock") ? (String) scenario.get("clock") : "virtual";
        String t0;
        try (Connection admin = DriverManager.getConnection(url); Statement st = admin.createStatement()) {
            for (Object statement : list(api.get("reset"))) {
                st.execute((String) statement);
            }
            try (ResultSet rs = st.executeQuery((String) obj(api.get("clock")).get("t0"))) {
                rs.next();
                t0 = rs.getString(1);
            }
        }
        String session = "a";
        BigDecimal at = BigDecimal.ZERO;
        try {
            List<Object> steps = list(scenario.get("steps"));
            for (int index = 0; index < steps.size(); index++) {
                Map<String, Object> step = obj(steps.get(index));
                String where = "step " + (index + 1) + (step.containsKey("note") ? " (" + step.get("note") + ")" : "");
                if (step.containsKey("session")) {
                    session = (String) step.get("session");
                }
                if (step.containsKey("at")) {
                    at = (BigDecimal) step.get("at");
                }
                Connection conn = conns.get(session);
                if (conn == null) {
                    conn = DriverManager.getConnection(url);
                    conns.put(session, conn);
                }
                Map<String, Object> expect = step.containsKey("expect") ? obj(step.get("expect")) : null;
                Call call;
                if (step.containsKey("sql")) {
                    call = expect != null
                            ? new Call(fill((String) api.get("wrap_query"), Map.of("sql", (String) step.get("sql"))),
                                    List.of(), Map.of(), "sql")
                            : new Call((String) step.get("sql"), List.of(), Map.of(), "void");
                } else {
                    Call c = buildCall(step, clock, at, refs);
                    call = new Call(fill(c.sql(), Map.of("t0", "'" + t0 + "'")), c.params(), c.columns(), c.shape());
                }
                List<Map<String, String>> rows;
                Map<String, Object> wantError = step.containsKey("error") ? obj(step.get("error")) : null;
                ran++;
                try {
                    if (step.containsKey("sql")) {
                        // Sent as is, as the other runners do (a Statement binds no ?).
                        try (Statement st = conn.createStatement()) {
                            rows = st.execute(call.sql()) ? rows(st.getResultSet()) : List.of();
                        }
                    } else {
                        try (PreparedStatement ps = conn.prepareStatement(call.sql())) {
                            for (int p = 0; p < call.params().size(); p++) {
                                // Untyped, as the other drivers send text: the SQL casts it.
                                ps.setObject(p + 1, call.params().get(p), java.sql.Types.OTHER);
                            }
                            try (ResultSet rs = ps.executeQuery()) {
                                rows = rows(rs);
                            }
                        }
                    }
                } catch (PSQLException e) {
                    ServerErrorMessage sem = e.getServerErrorMessage();
                    if (sem == null) {
                        throw e;
                    }
                    String code = e.getSQLState();
                    if (wantError == null) {
                        failures.add(where + ": unexpected error " + code + ": " + sem.getMessage());
                        continue;
                    }
                    checks += wantError.containsKey("column") ? 2 : 1;
                    if (!code.equals(wantError.get("sqlstate"))) {
                        failures.add(where + ": SQLSTATE " + code + ", expected " + wantError.get("sqlstate")
                                + ": " + sem.getMessage());
                    }
                    if (wantError.containsKey("column") && !Objects.equals(sem.getColumn(), wantError.get("column"))) {
                        failures.add(where + ": error COLUMN " + show(sem.getColumn()) + ", expected "
                                + show(wantError.get("column")));
                    }
                    continue;
                }
                if (wantError != null) {
                    failures.add(where + ": succeeded, expected SQLSTATE " + wantError.get("sqlstate"));
                    continue;
                }
                if (expect == null) {
                    continue;
                }
                Map<String, String> kinds = call.columns();
                if (call.shape().equals("sql")) {
                    checks++;
                    Object got = Json.parse(rows.get(0).get("rows"));
                    if (!Json.equal(got, expect.get("rows"))) {
                        failures.add(where + ": rows " + show(got) + ", expected " + show(expect.get("rows")));
                    }
                    continue;
                }
                if (call.shape().equals("rows")) {
                    checks++;
                    List<Object> want = list(expect.get("rows"));
                    List<Object> got = new ArrayList<>();
                    for (Map<String, String> r : rows) {
                        Map<String, Object> record = new LinkedHashMap<>();
                        if (!want.isEmpty()) {
                            for (String k : obj(want.get(0)).keySet()) {
                                record.put(k, value(kinds.get(k), r.get(k)));
                            }
                        }
                        got.add(record);
                    }
                    if (!Json.equal(got, want)) {
                        failures.add(where + ": rows " + show(got) + ", expected " + show(want));
                    }
                    continue;
                }
                if (rows.size() != 1) {
                    failures.add(where + ": " + rows.size() + " rows, expected one");
                    continue;
                }
                Map<String, String> record = rows.get(0);
                for (Map.Entry<String, Object> e : expect.entrySet()) {
                    String col = e.getKey();
                    Object matcher = e.getValue();
                    Object got = value(kinds.get(col), record.get(col));
                    for (Object[] check : matcherChecks(matcher)) {
                        checks++;
                        String op = (String) check[0];
                        boolean ok = switch (op) {
                            case "is_null" -> got == null;
                            case "not_null" -> got != null;
                            default -> compare(op, got, (Boolean) check[1] ? captures.get((String) check[2]) : check[2]);
                        };
                        if (!ok) {
                            failures.add(where + " " + col + ": got " + show(got) + ", expected " + op + " "
                                    + show(check[2]));
                        }
                    }
                    if (isMatcher(matcher) && obj(matcher).containsKey("$capture")) {
                        String name = (String) obj(matcher).get("$capture");
                        captures.put(name, got);
                        refs.put(name, record.get(col));
                    }
                }
            }
        } finally {
            for (Connection c : conns.values()) {
                c.close();
            }
        }
        return new Outcome(failures, ran, checks);
    }

    public static void main(String[] args) throws IOException {
        if (args.length < 3) {
            System.err.println("usage: java Run FUNCTIONS.json DSN SCENARIO.json...");
            System.exit(2);
        }
        Run runner = new Run(obj(Json.parse(Files.readString(Path.of(args[0]), StandardCharsets.UTF_8))));
        String url = jdbcUrl(args[1]);
        boolean failed = false;
        for (int k = 2; k < args.length; k++) {
            Map<String, Object> scenario = obj(Json.parse(Files.readString(Path.of(args[k]), StandardCharsets.UTF_8)));
            Outcome result;
            try {
                result = runner.runScenario(url, scenario);
            } catch (SQLException e) {
                System.err.println(args[k] + ": " + e);
                System.exit(2);
                return;
            }
            failed |= !result.failures().isEmpty();
            Map<String, Object> line = new LinkedHashMap<>();
            line.put("file", args[k]);
            line.put("name", scenario.get("name"));
            line.put("failures", new ArrayList<Object>(result.failures()));
            line.put("steps", result.steps());
            line.put("checks", result.checks());
            System.out.println(Json.write(line));
        }
        System.exit(failed ? 1 : 0);
    }
}
