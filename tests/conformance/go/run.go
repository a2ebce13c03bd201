// Runner 4: Go with database/sql and lib/pq (Debian's golang-github-lib-pq-dev) and nothing
// of ours: it reads the scenario files and calls the idempotency.* SQL functions by name, one
// connection a session.
//
//	run FUNCTIONS.json DSN SCENARIO.json...
//
// Prints one JSON line a scenario: {"file", "name", "failures": [...], "steps", "checks"} (the
// steps it ran and the comparisons it made, which the tests compare with the scenario's, so
// that a skipped step or check fails); exits 0 when every scenario passed, 1 when one failed,
// 2 on a usage or connection error. Arguments are bound
// and results read as functions.json says, the same way as the other runners
// (tests/conformance/README.md). Built offline: GO111MODULE=off GOPATH=/usr/share/gocode.
package main

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"os"
	"regexp"
	"sort"
	"strconv"
	"strings"

	"github.com/lib/pq"
)

type function struct {
	Args    [][2]string `json:"args"`
	Returns string      `json:"returns"`
}

type apiSpec struct {
	Functions map[string]function    `json:"functions"`
	Types     map[string][][2]string `json:"types"`
	Bind      map[string]string      `json:"bind"`
	Project   map[string]string      `json:"project"`
	Clock     map[string]string      `json:"clock"`
	WrapQuery string                 `json:"wrap_query"`
	Reset     []string               `json:"reset"`
}

var api apiSpec

var placeholder = regexp.MustCompile(`\{(\w+)\}`)

// fill replaces {name} by values[name], leaving unknown names as they are (like run.mjs).
func fill(template string, values map[string]string) string {
	return placeholder.ReplaceAllStringFunc(template, func(m string) string {
		if v, ok := values[m[1:len(m)-1]]; ok {
			return v
		}
		return m
	})
}

func kindOf(sqlType string) string {
	switch sqlType {
	case "integer":
		return "int"
	case "bigint":
		return "bigint"
	case "timestamptz", "interval":
		return "float"
	case "boolean":
		return "bool"
	case "jsonb":
		return "json"
	}
	return "text"
}

func decode(data []byte, v any) error {
	d := json.NewDecoder(bytes.NewReader(data))
	d.UseNumber() // numbers keep their spelling: "10.0" is sent as 10.0
	return d.Decode(v)
}

func encode(v any) string {
	var buf bytes.Buffer
	e := json.NewEncoder(&buf)
	e.SetEscapeHTML(false)
	if err := e.Encode(v); err != nil {
		panic(err)
	}
	return strings.TrimSuffix(buf.String(), "\n")
}

// argText: a scenario argument as the text every runner sends (nil for SQL NULL).
func argText(sqlType string, value any) any {
	switch v := value.(type) {
	case nil:
		return nil
	case string:
		if sqlType == "text[]" {
			return encode(v)
		}
		return v
	case bool:
		if sqlType == "jsonb" || sqlType == "text[]" {
			return encode(v)
		}
		return strconv.FormatBool(v)
	case json.Number:
		return v.String()
	default:
		return encode(v)
	}
}

type call struct {
	sql     string
	params  []any
	columns [][2]string // name, kind
	shape   string
}

func project(sqlType, expr string) string {
	t, ok := api.Project[sqlType]
	if !ok {
		t = api.Project["*"]
	}
	return fill(t, map[string]string{"v": expr})
}

func buildCall(step map[string]any, clock string, at float64, refs map[string]any) call {
	name := step["call"].(string)
	fn := api.Functions[name]
	given, _ := step["args"].(map[string]any)
	var params []any
	var parts []string
	for _, a := range fn.Args {
		arg, sqlType := a[0], a[1]
		if arg == "reference_time" && clock == "virtual" {
			parts = append(parts, "reference_time => "+fill(api.Clock["reference_time"],
				map[string]string{"at": strconv.FormatFloat(at, 'f', -1, 64)}))
			continue
		}
		value, ok := given[arg]
		if !ok {
			continue
		}
		var text any
		if m, isMap := value.(map[string]any); isMap && m["$ref"] != nil {
			text = refs[m["$ref"].(string)]
		} else {
			text = argText(sqlType, value)
		}
		params = append(params, text)
		t, ok := api.Bind[sqlType]
		if !ok {
			t = api.Bind["*"]
		}
		parts = append(parts, arg+" => "+fill(t, map[string]string{
			"p": "$" + strconv.Itoa(len(params)), "type": sqlType}))
	}
	invocation := "idempotency." + name + "(" + strings.Join(parts, ", ") + ")"
	if fn.Returns == "void" {
		return call{"SELECT (" + invocation + ") IS NULL AS value", params, nil, "void"}
	}
	typeName := strings.TrimPrefix(fn.Returns, "setof ")
	if cols, ok := api.Types[typeName]; ok {
		var proj []string
		var columns [][2]string
		for _, c := range cols {
			proj = append(proj, project(c[1], "r."+c[0])+" AS "+c[0])
			columns = append(columns, [2]string{c[0], kindOf(c[1])})
		}
		if strings.HasPrefix(fn.Returns, "setof ") {
			return call{"SELECT " + strings.Join(proj, ", ") + " FROM " + invocation +
				" WITH ORDINALITY AS r ORDER BY r.ordinality", params, columns, "rows"}
		}
		return call{"SELECT " + strings.Join(proj, ", ") + " FROM " + invocation + " AS r",
			params, columns, "row"}
	}
	return call{"SELECT " + project(fn.Returns, invocation) + " AS value", params,
		[][2]string{{"value", kindOf(fn.Returns)}}, "value"}
}

// value reads a projected column (its text) as the kind says: numbers as json.Number.
func value(kind string, text sql.NullString) any {
	if !text.Valid {
		return nil
	}
	switch kind {
	case "int", "bigint", "float":
		return json.Number(text.String)
	case "bool":
		return text.String == "true" || text.String == "t"
	case "json":
		var v any
		if err := decode([]byte(text.String), &v); err != nil {
			panic(err)
		}
		return v
	}
	return text.String
}

func rat(v any) (*big.Rat, bool) {
	n, ok := v.(json.Number)
	if !ok {
		return nil, false
	}
	r, ok := new(big.Rat).SetString(n.String())
	return r, ok
}

// jsonEqual: JSON equality as jsonb has it (numbers by value, booleans apart from numbers).
func jsonEqual(a, b any) bool {
	switch x := a.(type) {
	case nil:
		return b == nil
	case json.Number:
		ra, ok1 := rat(x)
		rb, ok2 := rat(b)
		return ok1 && ok2 && ra.Cmp(rb) == 0
	case map[string]any:
		y, ok := b.(map[string]any)
		if !ok || len(x) != len(y) {
			return false
		}
		for k, v := range x {
			w, ok := y[k]
			if !ok || !jsonEqual(v, w) {
				return false
			}
		}
		return true
	case []any:
		y, ok := b.([]any)
		if !ok || len(x) != len(y) {
			return false
		}
		for i := range x {
			if !jsonEqual(x[i], y[i]) {
				return false
			}
		}
		return true
	default:
		return a == b // string, bool
	}
}

func isMatcher(v any) bool {
	m, ok := v.(map[string]any)
	if !ok {
		return false
	}
	for k := range m {
		if strings.HasPrefix(k, "$") {
			return true
		}
	}
	return false
}

type check struct {
	op      string
	ref     bool
	operand any
}

// matcherChecks: same checks, in the same order, as matcher_checks() in __init__.py.
func matcherChecks(m any) []check {
	if !isMatcher(m) {
		if m == nil {
			return []check{{op: "is_null"}}
		}
		return []check{{"eq", false, m}}
	}
	mm := m.(map[string]any)
	var checks []check
	_, nn := mm["$not_null"]
	_, cp := mm["$capture"]
	if nn || cp {
		checks = append(checks, check{op: "not_null"})
	}
	for _, op := range []string{"$eq", "$ne", "$gt", "$lt"} {
		if v, ok := mm[op]; ok {
			_, isRef := v.(string)
			checks = append(checks, check{op[1:], isRef, v})
		}
	}
	return checks
}

func compare(op string, got, want any) bool {
	switch op {
	case "eq":
		return jsonEqual(got, want)
	case "ne":
		return !jsonEqual(got, want)
	}
	g, ok1 := rat(got)
	w, ok2 := rat(want)
	if !ok1 || !ok2 {
		return false
	}
	if op == "gt" {
		return g.Cmp(w) > 0
	}
	return g.Cmp(w) < 0
}

func show(v any) string { return encode(v) }

type session struct{ conn *sql.Conn }

// outcome: what runScenario found, and how much of the scenario it ran.
type outcome struct {
	failures      []string
	steps, checks int
}

func runScenario(ctx context.Context, db *sql.DB, scenario map[string]any) (outcome, error) {
	failures := []string{}
	steps, checks := 0, 0
	captures := map[string]any{} // as compared
	refs := map[string]any{}     // as the database wrote them, for {"$ref": …}
	clock, _ := scenario["clock"].(string)
	if clock == "" {
		clock = "virtual"
	}
	admin, err := db.Conn(ctx)
	if err != nil {
		return outcome{}, err
	}
	for _, statement := range api.Reset {
		if _, err := admin.ExecContext(ctx, statement); err != nil {
			admin.Close()
			return outcome{}, err
		}
	}
	var t0 string
	err = admin.QueryRowContext(ctx, api.Clock["t0"]).Scan(&t0)
	admin.Close()
	if err != nil {
		return outcome{}, err
	}
	conns := map[string]*sql.Conn{}
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	current, at := "a", 0.0
	for i, raw := range scenario["steps"].([]any) {
		step := raw.(map[string]any)
		where := fmt.Sprintf("step %d", i+1)
		if note, ok := step["note"].(string); ok {
			where += " (" + note + ")"
		}
		if s, ok := step["session"].(string); ok {
			current = s
		}
		if a, ok := step["at"].(json.Number); ok {
			at, _ = a.Float64()
		}
		conn, ok := conns[current]
		if !ok {
			if conn, err = db.Conn(ctx); err != nil {
				return outcome{}, err
			}
			conns[current] = conn
		}
		expect, hasExpect := step["expect"].(map[string]any)
		var c call
		if text, isSQL := step["sql"].(string); isSQL {
			if hasExpect {
				c = call{fill(api.WrapQuery, map[string]string{"sql": text}), nil,
					[][2]string{{"rows", "json"}}, "sql"}
			} else {
				c = call{text, nil, nil, "void"}
			}
		} else {
			c = buildCall(step, clock, at, refs)
			c.sql = fill(c.sql, map[string]string{"t0": "'" + t0 + "'"})
		}
		steps++
		rows, err := query(ctx, conn, c)
		want, wantsError := step["error"].(map[string]any)
		if err != nil {
			var pqErr *pq.Error
			if !errors.As(err, &pqErr) {
				return outcome{}, err
			}
			if !wantsError {
				failures = append(failures, fmt.Sprintf("%s: unexpected error %s: %s",
					where, pqErr.Code, pqErr.Message))
				continue
			}
			checks++
			if string(pqErr.Code) != want["sqlstate"] {
				failures = append(failures, fmt.Sprintf("%s: SQLSTATE %s, expected %s: %s",
					where, pqErr.Code, want["sqlstate"], pqErr.Message))
			}
			if wantColumn, ok := want["column"]; ok {
				checks++
				var got any
				if pqErr.Column != "" {
					got = pqErr.Column
				}
				if got != wantColumn {
					failures = append(failures, fmt.Sprintf("%s: error COLUMN %s, expected %s",
						where, show(got), show(wantColumn)))
				}
			}
			continue
		}
		if wantsError {
			failures = append(failures, fmt.Sprintf("%s: succeeded, expected SQLSTATE %s",
				where, want["sqlstate"]))
			continue
		}
		if !hasExpect {
			continue
		}
		kinds := map[string]string{}
		for _, col := range c.columns {
			kinds[col[0]] = col[1]
		}
		switch c.shape {
		case "sql":
			checks++
			got := value("json", rows[0]["rows"])
			if !jsonEqual(got, expect["rows"]) {
				failures = append(failures, fmt.Sprintf("%s: rows %s, expected %s",
					where, show(got), show(expect["rows"])))
			}
			continue
		case "rows":
			checks++
			wantRows := expect["rows"].([]any)
			var keys []string
			if len(wantRows) > 0 {
				for k := range wantRows[0].(map[string]any) {
					keys = append(keys, k)
				}
				sort.Strings(keys)
			}
			got := []any{}
			for _, r := range rows {
				record := map[string]any{}
				for _, k := range keys {
					record[k] = value(kinds[k], r[k])
				}
				got = append(got, record)
			}
			if !jsonEqual(got, wantRows) {
				failures = append(failures, fmt.Sprintf("%s: rows %s, expected %s",
					where, show(got), show(wantRows)))
			}
			continue
		}
		if len(rows) != 1 {
			failures = append(failures, fmt.Sprintf("%s: %d rows, expected one", where, len(rows)))
			continue
		}
		cols := make([]string, 0, len(expect))
		for col := range expect {
			cols = append(cols, col)
		}
		sort.Strings(cols)
		for _, col := range cols {
			matcher := expect[col]
			got := value(kinds[col], rows[0][col])
			for _, ch := range matcherChecks(matcher) {
				checks++
				var ok bool
				switch ch.op {
				case "is_null":
					ok = got == nil
				case "not_null":
					ok = got != nil
				default:
					w := ch.operand
					if ch.ref {
						w = captures[w.(string)]
					}
					ok = compare(ch.op, got, w)
				}
				if !ok {
					failures = append(failures, fmt.Sprintf("%s %s: got %s, expected %s %s",
						where, col, show(got), ch.op, show(ch.operand)))
				}
			}
			if m, isMap := matcher.(map[string]any); isMap && isMatcher(m) {
				if name, ok := m["$capture"].(string); ok {
					captures[name] = got
					if rows[0][col].Valid {
						refs[name] = rows[0][col].String
					} else {
						refs[name] = nil
					}
				}
			}
		}
	}
	return outcome{failures, steps, checks}, nil
}

// query runs one statement and reads every column as text (NULL: not Valid).
func query(ctx context.Context, conn *sql.Conn, c call) ([]map[string]sql.NullString, error) {
	rows, err := conn.QueryContext(ctx, c.sql, c.params...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	names, err := rows.Columns()
	if err != nil {
		return nil, err
	}
	var out []map[string]sql.NullString
	for rows.Next() {
		cells := make([]sql.NullString, len(names))
		ptrs := make([]any, len(names))
		for i := range cells {
			ptrs[i] = &cells[i]
		}
		if err := rows.Scan(ptrs...); err != nil {
			return nil, err
		}
		record := map[string]sql.NullString{}
		for i, n := range names {
			record[n] = cells[i]
		}
		out = append(out, record)
	}
	return out, rows.Err()
}

func main() {
	os.Exit(run())
}

func run() int {
	if len(os.Args) < 4 {
		fmt.Fprintln(os.Stderr, "usage: run FUNCTIONS.json DSN SCENARIO.json...")
		return 2
	}
	data, err := os.ReadFile(os.Args[1])
	if err == nil {
		err = json.Unmarshal(data, &api)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	dsn := os.Args[2]
	if !strings.Contains(dsn, "sslmode=") {
		// lib/pq defaults to sslmode=require, libpq to prefer: the test servers have no TLS.
		sep := "?"
		if strings.Contains(dsn, "?") {
			sep = "&"
		}
		dsn += sep + "sslmode=disable"
	}
	db, err := sql.Open("postgres", dsn)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	defer db.Close()
	ctx := context.Background()
	failed := false
	for _, file := range os.Args[3:] {
		data, err := os.ReadFile(file)
		var scenario map[string]any
		if err == nil {
			err = decode(data, &scenario)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
		result, err := runScenario(ctx, db, scenario)
		if err != nil {
			fmt.Fprintf(os.Stderr, "%s: %v\n", file, err)
			return 2
		}
		failed = failed || len(result.failures) > 0
		fmt.Println(encode(map[string]any{"file": file, "name": scenario["name"],
			"failures": result.failures, "steps": result.steps, "checks": result.checks}))
	}
	if failed {
		return 1
	}
	return 0
}
