# frozen_string_literal: true

# Runner 6: Ruby with the pg gem (Debian's ruby-pg) and nothing of ours: it reads the scenario
# files and calls the idempotency.* SQL functions by name, one connection a session.
#
#   ruby run.rb FUNCTIONS.json DSN SCENARIO.json...
#
# Prints one JSON line a scenario: {"file", "name", "failures": [...], "steps", "checks"} (the
# steps it ran and the comparisons it made, which the tests compare with the scenario's, so
# that a skipped step or check fails); exits 0 when every scenario passed, 1 when one failed,
# 2 on a usage or connection error. Arguments are bound
# and results read as functions.json says, the same way as the other runners
# (tests/conformance/README.md).

require "bigdecimal"
require "json"
require "pg"

KIND = { "integer" => "int", "bigint" => "bigint", "timestamptz" => "float",
         "interval" => "float", "boolean" => "bool", "jsonb" => "json" }.freeze

def kind_of(sql_type) = KIND.fetch(sql_type, "text")

# Numbers as exact decimals, so that jsonb's "numbers by value" is Ruby's ==.
def parse_json(text) = JSON.parse(text, decimal_class: BigDecimal)

# {name} replaced by values[name]; unknown names stay (like run.mjs).
def fill(template, values)
  template.gsub(/\{(\w+)\}/) { values.key?(Regexp.last_match(1)) ? values[Regexp.last_match(1)] : Regexp.last_match(0) }
end

# Scenario numbers keep their spelling when sent (10.0 stays 10.0).
def dump(value)
  case value
  when BigDecimal then value.to_s("F")
  when Hash then "{#{value.map { |k, v| "#{JSON.generate(k)}:#{dump(v)}" }.join(',')}}"
  when Array then "[#{value.map { |v| dump(v) }.join(',')}]"
  else JSON.generate(value)
  end
end

# A scenario argument as the text every runner sends (nil for SQL NULL).
def arg_text(sql_type, value)
  return nil if value.nil?
  return dump(value) if (sql_type == "jsonb" && !value.is_a?(String)) || sql_type == "text[]"
  return value.to_s("F") if value.is_a?(BigDecimal)

  value.to_s
end

class Runner
  def initialize(api)
    @api = api
  end

  def project(sql_type, expr)
    fill(@api["project"].fetch(sql_type, @api["project"]["*"]), { "v" => expr })
  end

  def build_call(step, clock, at, refs)
    fn = @api["functions"].fetch(step["call"])
    given = step.fetch("args", {})
    params = []
    parts = []
    fn["args"].each do |name, sql_type|
      if name == "reference_time" && clock == "virtual"
        at_text = at == at.to_i ? at.to_i.to_s : at.to_f.to_s
        parts << "reference_time => #{fill(@api['clock']['reference_time'], { 'at' => at_text })}"
        next
      end
      next unless given.key?(name)

      value = given[name]
      params << (value.is_a?(Hash) && value.key?("$ref") ? refs[value["$ref"]] : arg_text(sql_type, value))
      bind = @api["bind"].fetch(sql_type, @api["bind"]["*"])
      parts << "#{name} => #{fill(bind, { 'p' => "$#{params.size}", 'type' => sql_type })}"
    end
    call = "idempotency.#{step['call']}(#{parts.join(', ')})"
    returns = fn["returns"]
    return { sql: "SELECT (#{call}) IS NULL AS value", params: params, columns: {}, shape: "void" } if returns == "void"

    setof = returns.start_with?("setof ")
    type_name = returns.delete_prefix("setof ")
    if @api["types"].key?(type_name)
      cols = @api["types"][type_name]
      proj = cols.map { |c, t| "#{project(t, "r.#{c}")} AS #{c}" }.join(", ")
      columns = cols.to_h { |c, t| [c, kind_of(t)] }
      if setof
        return { sql: "SELECT #{proj} FROM #{call} WITH ORDINALITY AS r ORDER BY r.ordinality",
                 params: params, columns: columns, shape: "rows" }
      end
      return { sql: "SELECT #{proj} FROM #{call} AS r", params: params, columns: columns, shape: "row" }
    end
    { sql: "SELECT #{project(returns, call)} AS value", params: params,
      columns: { "value" => kind_of(returns) }, shape: "value" }
  end

  # A projected column (its text; pg gives every value as text) as its kind says.
  def value(kind, text)
    return nil if text.nil?

    case kind
    when "int", "bigint", "float" then BigDecimal(text)
    when "bool" then text == "t"
    when "json" then parse_json(text)
    else text
    end
  end

  def matcher?(v) = v.is_a?(Hash) && v.keys.any? { |k| k.start_with?("$") }

  # Same checks, in the same order, as matcher_checks() in tests/conformance/__init__.py.
  def matcher_checks(m)
    return m.nil? ? [["is_null", nil]] : [["eq", ["lit", m]]] unless matcher?(m)

    checks = []
    checks << ["not_null", nil] if m.key?("$not_null") || m.key?("$capture")
    %w[$eq $ne $gt $lt].each do |op|
      checks << [op[1..], m[op].is_a?(String) ? ["ref", m[op]] : ["lit", m[op]]] if m.key?(op)
    end
    checks
  end

  # JSON equality as jsonb has it: numbers by value, booleans apart from numbers.
  def json_equal(a, b)
    return a.is_a?(Numeric) && b.is_a?(Numeric) && a == b if a.is_a?(Numeric) || b.is_a?(Numeric)
    if a.is_a?(Hash) && b.is_a?(Hash)
      return a.keys.sort == b.keys.sort && a.all? { |k, v| json_equal(v, b[k]) }
    end
    if a.is_a?(Array) && b.is_a?(Array)
      return a.size == b.size && a.zip(b).all? { |x, y| json_equal(x, y) }
    end

    a.class == b.class && a == b
  end

  def compare(op, got, want)
    return json_equal(got, want) if op == "eq"
    return !json_equal(got, want) if op == "ne"
    return false unless got.is_a?(Numeric) && want.is_a?(Numeric)

    op == "gt" ? got > want : got < want
  end

  def show(v) = dump(v)

  # [failures, steps run, checks made]
  def run_scenario(dsn, scenario)
    failures = []
    steps = 0
    checks = 0
    captures = {}
    refs = {}
    conns = {}
    clock = scenario.fetch("clock", "virtual")
    admin = PG.connect(dsn)
    begin
      @api["reset"].each { |statement| admin.exec(statement) }
      t0 = admin.exec(@api["clock"]["t0"]).getvalue(0, 0)
    ensure
      admin.close
    end
    session = "a"
    at = 0
    scenario["steps"].each_with_index do |step, index|
      where = "step #{index + 1}#{step['note'] ? " (#{step['note']})" : ''}"
      session = step.fetch("session", session)
      at = step.fetch("at", at)
      conn = (conns[session] ||= PG.connect(dsn))
      expect = step["expect"]
      if step.key?("sql")
        call = if expect
                 { sql: fill(@api["wrap_query"], { "sql" => step["sql"] }), params: [], shape: "sql", columns: {} }
               else
                 { sql: step["sql"], params: [], shape: "void", columns: {} }
               end
      else
        call = build_call(step, clock, at, refs)
        call[:sql] = fill(call[:sql], { "t0" => "'#{t0}'" })
      end
      steps += 1
      begin
        result = call[:params].empty? ? conn.exec(call[:sql]) : conn.exec_params(call[:sql], call[:params])
        rows = result.to_a
      rescue PG::Error => e
        raise unless e.respond_to?(:result) && e.result

        code = e.result.error_field(PG::PG_DIAG_SQLSTATE)
        column = e.result.error_field(PG::PG_DIAG_COLUMN_NAME)
        message = e.result.error_field(PG::PG_DIAG_MESSAGE_PRIMARY)
        want = step["error"]
        if want.nil?
          failures << "#{where}: unexpected error #{code}: #{message}"
          next
        end
        checks += want.key?("column") ? 2 : 1
        failures << "#{where}: SQLSTATE #{code}, expected #{want['sqlstate']}: #{message}" if code != want["sqlstate"]
        if want.key?("column") && column != want["column"]
          failures << "#{where}: error COLUMN #{show(column)}, expected #{show(want['column'])}"
        end
        next
      end
      if step["error"]
        failures << "#{where}: succeeded, expected SQLSTATE #{step['error']['sqlstate']}"
        next
      end
      next if expect.nil?

      kinds = call[:columns]
      case call[:shape]
      when "sql"
        checks += 1
        got = parse_json(rows[0]["rows"])
        failures << "#{where}: rows #{show(got)}, expected #{show(expect['rows'])}" unless json_equal(got, expect["rows"])
        next
      when "rows"
        checks += 1
        keys = expect["rows"].empty? ? [] : expect["rows"][0].keys
        got = rows.map { |r| keys.to_h { |k| [k, value(kinds[k], r[k])] } }
        failures << "#{where}: rows #{show(got)}, expected #{show(expect['rows'])}" unless json_equal(got, expect["rows"])
        next
      end
      if rows.size != 1
        failures << "#{where}: #{rows.size} rows, expected one"
        next
      end
      record = rows[0]
      expect.each do |col, matcher|
        got = value(kinds[col], record[col])
        matcher_checks(matcher).each do |op, operand|
          checks += 1
          ok = case op
               when "is_null" then got.nil?
               when "not_null" then !got.nil?
               else compare(op, got, operand[0] == "ref" ? captures[operand[1]] : operand[1])
               end
          failures << "#{where} #{col}: got #{show(got)}, expected #{op} #{show(operand)}" unless ok
        end
        if matcher?(matcher) && matcher.key?("$capture")
          captures[matcher["$capture"]] = got
          refs[matcher["$capture"]] = record[col]
        end
      end
    end
    [failures, steps, checks]
  ensure
    conns&.each_value(&:close)
  end
end

def main(argv)
  if argv.size < 3
    warn "usage: ruby run.rb FUNCTIONS.json DSN SCENARIO.json..."
    return 2
  end
  api_file, dsn, *files = argv
  runner = Runner.new(JSON.parse(File.read(api_file, encoding: "UTF-8")))
  failed = false
  files.each do |file|
    scenario = parse_json(File.read(file, encoding: "UTF-8"))
    failures, steps, checks = runner.run_scenario(dsn, scenario)
    failed ||= !failures.empty?
    $stdout.puts JSON.generate({ "file" => file, "name" => scenario["name"], "failures" => failures,
                                 "steps" => steps, "checks" => checks })
  end
  failed ? 1 : 0
rescue PG::ConnectionBad => e
  warn e.message
  2
end

exit main(ARGV)
