// Runner 3: Node.js with node-postgres (`pg` from npm) and nothing of ours: it reads the
// scenario files and calls the idempotency.* SQL functions by name, one client a session.
//
//   node run.mjs DSN SCENARIO.json...
//
// Prints one JSON line a scenario: {"file", "name", "failures": [...], "steps", "checks"} (the
// steps it ran and the comparisons it made, which the tests compare with the scenario's, so
// that a skipped step or check fails); exits 0 when every scenario passed, 1 when one failed,
// 2 on a usage or connection error. Arguments are bound
// and results read as tests/conformance/functions.json says, the same way as the Python and
// psql runners (tests/conformance/README.md).

import { readFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { isDeepStrictEqual } from 'node:util';
import pg from 'pg';

const here = dirname(fileURLToPath(import.meta.url));
const api = JSON.parse(readFileSync(join(here, '..', 'functions.json'), 'utf8'));

const KIND = {
  integer: 'int', bigint: 'bigint', timestamptz: 'float', interval: 'float',
  boolean: 'bool', jsonb: 'json',
};
const kindOf = (sqlType) => KIND[sqlType] ?? 'text';

const fill = (template, values) => template.replace(/\{(\w+)\}/g, (m, k) => (k in values ? values[k] : m));

// A scenario argument as the text every runner sends (null for SQL NULL).
function argText(sqlType, value) {
  if (value === null || value === undefined) return null;
  if ((sqlType === 'jsonb' && typeof value !== 'string') || sqlType === 'text[]') {
    return JSON.stringify(value);
  }
  return String(value);
}

// JavaScript's String() of a number is what the Python runner writes too.
const numberText = (x) => String(x);

function project(sqlType, expr) {
  return fill(api.project[sqlType] ?? api.project['*'], { v: expr });
}

function buildCall(step, clock, at, refs) {
  const fn = api.functions[step.call];
  const given = step.args ?? {};
  const params = [];
  const parts = [];
  for (const [name, sqlType] of fn.args) {
    if (name === 'reference_time' && clock === 'virtual') {
      parts.push('reference_time => ' + fill(api.clock.reference_time, { at: numberText(at) }));
      continue;
    }
    if (!(name in given)) continue;
    const value = given[name];
    const text = value !== null && typeof value === 'object' && !Array.isArray(value) && '$ref' in value
      ? refs[value.$ref]
      : argText(sqlType, value);
    const placeholder = `$${params.length + 1}`;
    params.push(text);
    parts.push(`${name} => ` + fill(api.bind[sqlType] ?? api.bind['*'], { p: placeholder, type: sqlType }));
  }
  const call = `idempotency.${step.call}(${parts.join(', ')})`;
  const returns = fn.returns;
  if (returns === 'void') return { sql: `SELECT (${call}) IS NULL AS value`, params, columns: [], shape: 'void' };
  const setof = returns.startsWith('setof ');
  const typeName = setof ? returns.slice(6) : returns;
  if (typeName in api.types) {
    const cols = api.types[typeName];
    const proj = cols.map(([c, t]) => `${project(t, 'r.' + c)} AS ${c}`).join(', ');
    const columns = cols.map(([c, t]) => [c, kindOf(t)]);
    if (setof) {
      return {
        sql: `SELECT ${proj} FROM ${call} WITH ORDINALITY AS r ORDER BY r.ordinality`,
        params, columns, shape: 'rows',
      };
    }
    return { sql: `SELECT ${proj} FROM ${call} AS r`, params, columns, shape: 'row' };
  }
  return { sql: `SELECT ${project(returns, call)} AS value`, params, columns: [['value', kindOf(returns)]], shape: 'value' };
}

const isMatcher = (v) => v !== null && typeof v === 'object' && !Array.isArray(v)
  && Object.keys(v).some((k) => k.startsWith('$'));

// Same checks, in the same order, as matcher_checks() in tests/conformance/__init__.py.
function matcherChecks(m) {
  if (!isMatcher(m)) return m === null ? [['is_null', null]] : [['eq', ['lit', m]]];
  const checks = [];
  if ('$not_null' in m || '$capture' in m) checks.push(['not_null', null]);
  for (const op of ['$eq', '$ne', '$gt', '$lt']) {
    if (op in m) checks.push([op.slice(1), typeof m[op] === 'string' ? ['ref', m[op]] : ['lit', m[op]]]);
  }
  return checks;
}

// JSON equality as jsonb has it: numbers by value, booleans apart from numbers.
function jsonEqual(a, b) {
  if (Array.isArray(a) || Array.isArray(b)) {
    return Array.isArray(a) && Array.isArray(b) && a.length === b.length
      && a.every((x, i) => jsonEqual(x, b[i]));
  }
  if (a !== null && b !== null && typeof a === 'object' && typeof b === 'object') {
    const ka = Object.keys(a).sort();
    const kb = Object.keys(b).sort();
    return isDeepStrictEqual(ka, kb) && ka.every((k) => jsonEqual(a[k], b[k]));
  }
  return a === b;
}

function num(kind, v) {
  if (v === null || v === undefined) return null;
  if (kind === 'bigint') return BigInt(v);
  if (kind === 'float') return Number(v);
  return v;
}

function compare(kind, op, got, want) {
  if (op === 'eq') return kind === 'json' ? jsonEqual(got, want) : num(kind, got) === num(kind, want);
  if (op === 'ne') return !compare(kind, 'eq', got, want);
  if (got === null || want === null || want === undefined) return false;
  return op === 'gt' ? num(kind, got) > num(kind, want) : num(kind, got) < num(kind, want);
}

const show = (v) => JSON.stringify(v, (k, x) => (typeof x === 'bigint' ? x.toString() : x));

async function runScenario(dsn, scenario) {
  const failures = [];
  let steps = 0;
  let checks = 0;
  const captures = {};
  const clients = new Map();
  const clock = scenario.clock ?? 'virtual';
  const admin = new pg.Client({ connectionString: dsn });
  await admin.connect();
  let t0;
  try {
    for (const statement of api.reset) await admin.query(statement);
    t0 = (await admin.query(api.clock.t0)).rows[0].t0;
  } finally {
    await admin.end();
  }
  const t0Literal = `'${t0}'`;
  let session = 'a';
  let at = 0;
  try {
    for (const [index, step] of scenario.steps.entries()) {
      const where = `step ${index + 1}` + (step.note ? ` (${step.note})` : '');
      session = step.session ?? session;
      at = step.at ?? at;
      if (!clients.has(session)) {
        const client = new pg.Client({ connectionString: dsn });
        await client.connect();
        clients.set(session, client);
      }
      const client = clients.get(session);
      let sql;
      let params = [];
      let columns = [];
      let shape;
      if ('sql' in step) {
        sql = step.expect ? fill(api.wrap_query, { sql: step.sql }) : step.sql;
        shape = step.expect ? 'sql' : 'void';
      } else {
        const call = buildCall(step, clock, at, captures);
        sql = fill(call.sql, { t0: t0Literal });
        ({ params, columns, shape } = call);
      }
      let rows;
      steps += 1;
      try {
        rows = (await client.query(sql, params)).rows;
      } catch (err) {
        if (!(err instanceof pg.DatabaseError)) throw err;
        const want = step.error;
        if (!want) {
          failures.push(`${where}: unexpected error ${err.code}: ${err.message}`);
          continue;
        }
        checks += 'column' in want ? 2 : 1;
        if (err.code !== want.sqlstate) {
          failures.push(`${where}: SQLSTATE ${err.code}, expected ${want.sqlstate}: ${err.message}`);
        }
        if ('column' in want && (err.column ?? null) !== want.column) {
          failures.push(`${where}: error COLUMN ${show(err.column ?? null)}, expected ${show(want.column)}`);
        }
        continue;
      }
      if (step.error) {
        failures.push(`${where}: succeeded, expected SQLSTATE ${step.error.sqlstate}`);
        continue;
      }
      const expect = step.expect;
      if (!expect) continue;
      if (shape === 'sql') {
        checks += 1;
        if (!jsonEqual(rows[0].rows, expect.rows)) {
          failures.push(`${where}: rows ${show(rows[0].rows)}, expected ${show(expect.rows)}`);
        }
        continue;
      }
      const kinds = Object.fromEntries(columns);
      if (shape === 'rows') {
        checks += 1;
        const keys = expect.rows.length ? Object.keys(expect.rows[0]) : [];
        const got = rows.map((r) => Object.fromEntries(keys.map((k) => [k, kinds[k] === 'bigint' ? Number(r[k]) : r[k]])));
        if (!jsonEqual(got, expect.rows)) failures.push(`${where}: rows ${show(got)}, expected ${show(expect.rows)}`);
        continue;
      }
      if (rows.length !== 1) {
        failures.push(`${where}: ${rows.length} rows, expected one`);
        continue;
      }
      const record = rows[0];
      for (const [col, matcher] of Object.entries(expect)) {
        const got = record[col] ?? null;
        for (const [op, operand] of matcherChecks(matcher)) {
          checks += 1;
          let ok;
          if (op === 'is_null') ok = got === null;
          else if (op === 'not_null') ok = got !== null;
          else {
            const want = operand[0] === 'ref' ? captures[operand[1]] ?? null : operand[1];
            ok = compare(kinds[col], op, got, want);
          }
          if (!ok) failures.push(`${where} ${col}: got ${show(got)}, expected ${op} ${show(operand)}`);
        }
        if (isMatcher(matcher) && '$capture' in matcher) captures[matcher.$capture] = got;
      }
    }
  } finally {
    for (const client of clients.values()) await client.end();
  }
  return { failures, steps, checks };
}

async function main() {
  const [dsn, ...files] = process.argv.slice(2);
  if (!dsn || files.length === 0) {
    process.stderr.write('usage: node run.mjs DSN SCENARIO.json...\n');
    return 2;
  }
  let failed = false;
  for (const file of files) {
    const scenario = JSON.parse(readFileSync(file, 'utf8'));
    const { failures, steps, checks } = await runScenario(dsn, scenario);
    failed ||= failures.length > 0;
    process.stdout.write(JSON.stringify({ file, name: scenario.name, failures, steps, checks }) + '\n');
  }
  return failed ? 1 : 0;
}

main().then((code) => { process.exitCode = code; }, (err) => {
  process.stderr.write(`${err.stack ?? err}\n`);
  process.exitCode = 2;
});
