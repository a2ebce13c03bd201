-- canonical_json, fingerprint and derive_key, against the definition in docs/fingerprint.md.
-- Expected hashes were computed outside PostgreSQL (Python hashlib) from the canonical text.
BEGIN;

SELECT plan(69);

-- canonical_json: objects ---------------------------------------------------------------------

SELECT is(
    idempotency.canonical_json('{"b": 1, "a": 2}'), '{"a":2,"b":1}',
    'canonical_json: members sorted by key, no whitespace'
);
SELECT is(
    idempotency.canonical_json('{"bb": 1, "a": 2, "c": 3}'), '{"a":2,"bb":1,"c":3}',
    'canonical_json: sorted by code point, not by jsonb''s length-first order'
);
SELECT is(
    idempotency.canonical_json('{"é": 1, "z": 2, "Z": 3, "ｚ": 4, "😀": 5, "€": 6, "a": 7}'),
    '{"Z":3,"a":7,"z":2,"é":1,"€":6,"ｚ":4,"😀":5}',
    'canonical_json: non-ASCII keys in code point order (U+FF5A before U+1F600, unlike UTF-16)'
);
SELECT is(
    idempotency.canonical_json('{"a": 1, "a": 2}'), '{"a":2}',
    'canonical_json: of duplicate keys the last one counts'
);
SELECT is(
    idempotency.canonical_json('{"a\"b": 1, "\n": 2, "a\\b": 3}'),
    '{"\n":2,"a\"b":1,"a\\b":3}',
    'canonical_json: keys are escaped like strings and sorted by their unescaped value'
);
SELECT is(
    idempotency.canonical_json('{"b": [1.50, "x\ny"], "a": 1e2, "é": "ü"}'),
    '{"a":100,"b":[1.5,"x\ny"],"é":"ü"}',
    'canonical_json: the example of docs/fingerprint.md'
);
SELECT is(
    idempotency.canonical_json('[{"b": {"d": 1, "c": [{"f": 1, "e": 2}]}, "a": []}]'),
    '[{"a":[],"b":{"c":[{"e":2,"f":1}],"d":1}}]',
    'canonical_json: nested objects inside arrays inside objects are all sorted'
);
SELECT is(
    idempotency.canonical_json('[[3, [2, [1]]], [], {}]'), '[[3,[2,[1]]],[],{}]',
    'canonical_json: nested arrays keep their order'
);
SELECT is(
    idempotency.canonical_json('{}'), '{}',
    'canonical_json: empty object'
);
SELECT is(
    idempotency.canonical_json('[]'), '[]',
    'canonical_json: empty array'
);
SELECT is(
    idempotency.canonical_json('{"a": {}, "b": []}'), '{"a":{},"b":[]}',
    'canonical_json: empty object and array as members'
);
SELECT is(
    idempotency.canonical_json('{"a": null, "c": false, "b": true}'),
    '{"a":null,"b":true,"c":false}',
    'canonical_json: null, true and false as members'
);
SELECT is(
    idempotency.canonical_json('[null, true, false]'), '[null,true,false]',
    'canonical_json: null, true and false as array elements'
);
SELECT is(
    idempotency.canonical_json('null'), 'null',
    'canonical_json: top-level null'
);
SELECT is(
    idempotency.canonical_json('true'), 'true',
    'canonical_json: top-level true'
);
SELECT is(
    idempotency.canonical_json(NULL), NULL,
    'canonical_json: SQL NULL gives NULL'
);

-- canonical_json: numbers ---------------------------------------------------------------------

SELECT is(idempotency.canonical_json('10'), '10', 'canonical_json: 10');
SELECT is(idempotency.canonical_json('10.0'), '10', 'canonical_json: 10.0 is 10');
SELECT is(idempotency.canonical_json('1e1'), '10', 'canonical_json: 1e1 is 10');
SELECT is(idempotency.canonical_json('1.0E+1'), '10', 'canonical_json: 1.0E+1 is 10');
SELECT is(idempotency.canonical_json('-0'), '0', 'canonical_json: -0 is 0');
SELECT is(idempotency.canonical_json('-0.0'), '0', 'canonical_json: -0.0 is 0');
SELECT is(idempotency.canonical_json('0.000'), '0', 'canonical_json: 0.000 is 0');
SELECT is(idempotency.canonical_json('1.50'), '1.5', 'canonical_json: 1.50 is 1.5');
SELECT is(idempotency.canonical_json('-1.50'), '-1.5', 'canonical_json: -1.50 is -1.5');
SELECT is(idempotency.canonical_json('1e-7'), '0.0000001', 'canonical_json: 1e-7, no exponent');
SELECT is(idempotency.canonical_json('0.1e1'), '1', 'canonical_json: 0.1e1 is 1');
SELECT is(
    idempotency.canonical_json('1e30'), '1e30',
    'canonical_json: 1e30 (from 1e21 on) with an exponent, not expanded'
);
SELECT is(
    idempotency.canonical_json('9007199254740993'), '9007199254740993',
    'canonical_json: 2^53 + 1 is not rounded through binary floating point'
);
SELECT is(
    idempotency.canonical_json('123456789012345678901234567890.1230'),
    '1.23456789012345678901234567890123e29',
    'canonical_json: a large decimal keeps every digit, trailing zero dropped'
);
SELECT is(
    idempotency.canonical_json('0.1'), '0.1',
    'canonical_json: 0.1 stays exact'
);
SELECT is(
    idempotency.canonical_json('[10.0, 1e1, {"a": 1.0E+1, "b": [-0.0]}]'),
    '[10,10,{"a":10,"b":[0]}]',
    'canonical_json: numbers inside arrays and objects are normalised too'
);

-- canonical_json: strings ---------------------------------------------------------------------

SELECT is(
    idempotency.canonical_json('"say \"hi\""'), '"say \"hi\""',
    'canonical_json: a quote is escaped as \"'
);
SELECT is(
    idempotency.canonical_json('"a\\b"'), '"a\\b"',
    'canonical_json: a backslash is escaped as \\'
);
SELECT is(
    idempotency.canonical_json('"\u0008\u000c\u000a\u000d\u0009"'), '"\b\f\n\r\t"',
    'canonical_json: U+0008, U+000C, U+000A, U+000D, U+0009 as \b \f \n \r \t'
);
SELECT is(
    idempotency.canonical_json('"a\u0001b\u001fc\u000Bd"'), '"a\u0001b\u001fc\u000bd"',
    'canonical_json: other control characters as \u00xx in lower-case hex'
);
SELECT is(
    idempotency.canonical_json('"a\/b/c"'), '"a/b/c"',
    'canonical_json: / is written as itself, never \/'
);
SELECT is(
    idempotency.canonical_json('"a\u007fb"'), E'"a\x7fb"',
    'canonical_json: U+007F is written as itself'
);
SELECT is(
    idempotency.canonical_json('"\u00e9\u20ac\ud83d\ude00 ü"'), '"é€😀 ü"',
    'canonical_json: non-ASCII characters (escaped or not in the input) as themselves'
);
SELECT is(
    idempotency.canonical_json('["", " x "]'), '[""," x "]',
    'canonical_json: whitespace inside strings is kept'
);

-- fingerprint ----------------------------------------------------------------------------------

SELECT is(
    encode(idempotency.fingerprint('{}'), 'hex'),
    '44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a',
    'fingerprint({}) is sha256 of "{}"'
);
SELECT is(
    encode(idempotency.fingerprint('{"b": [1.50, "x\ny"], "a": 1e2, "é": "ü"}'), 'hex'),
    'c054540944373c2d9f002a5dda7a36c231a32b118dde2248515aba4501b200c1',
    'fingerprint is sha256 of the UTF-8 canonical text (docs example)'
);
SELECT is(
    encode(idempotency.fingerprint('{"currency": "EUR", "amount": 5e1}'), 'hex'),
    '9603d0dfbc14c2d768427a7ee8e7ef0cfc5eda368186ed9090878825de7ad0f9',
    'fingerprint: a known vector with a number in exponent notation'
);
SELECT is_empty(
    $$SELECT r FROM (VALUES ('{"z": [1, {"y": "ü"}], "a": -0.50}'::jsonb), ('[1, 2, 3]'),
                            ('"text"'), ('12.500'), ('null'), ('{"😀": {"\n": true}}')) AS t (r)
      WHERE idempotency.fingerprint(r)
            IS DISTINCT FROM sha256(convert_to(idempotency.canonical_json(r), 'UTF8'))$$,
    'fingerprint = sha256(convert_to(canonical_json(request), UTF8)) for any JSON value'
);
SELECT is(
    octet_length(idempotency.fingerprint('{"a": 1}')), 32,
    'fingerprint is 32 bytes'
);
SELECT isnt(
    idempotency.fingerprint('{"a": 1}'), idempotency.fingerprint('{"a": "1"}'),
    'fingerprint: the number 1 and the string "1" differ'
);
SELECT isnt(
    idempotency.fingerprint('[1, 2]'), idempotency.fingerprint('[2, 1]'),
    'fingerprint: array order matters'
);

-- fingerprint: defaults ------------------------------------------------------------------------

SELECT is(
    idempotency.fingerprint('{"amount": 5}', defaults => '{"currency": "EUR"}'),
    idempotency.fingerprint('{"amount": 5, "currency": "EUR"}'),
    'defaults: an omitted field takes its default'
);
SELECT is(
    idempotency.fingerprint('{"amount": 5}', defaults => '{"currency": "EUR"}'),
    idempotency.fingerprint('{"amount": 5, "currency": "EUR"}', defaults => '{"currency": "EUR"}'),
    'defaults: omitting a field equals sending its default'
);
SELECT is(
    idempotency.fingerprint('{"currency": "USD"}', defaults => '{"currency": "EUR"}'),
    idempotency.fingerprint('{"currency": "USD"}'),
    'defaults: the request wins over the default'
);
SELECT isnt(
    idempotency.fingerprint('{"currency": null}', defaults => '{"currency": "EUR"}'),
    idempotency.fingerprint('{}', defaults => '{"currency": "EUR"}'),
    'defaults: an explicit null differs from an omitted field'
);
SELECT is(
    idempotency.fingerprint('{"currency": null}', defaults => '{"currency": "EUR"}'),
    idempotency.fingerprint('{"currency": null}'),
    'defaults: an explicit null is kept as a value'
);
SELECT is(
    idempotency.fingerprint('{"opts": {"b": 2}}', defaults => '{"opts": {"a": 1}}'),
    idempotency.fingerprint('{"opts": {"b": 2}}'),
    'defaults: the merge is shallow (a nested object is replaced, not merged)'
);
SELECT is(
    idempotency.fingerprint('{"a": 1}', defaults => '{}'),
    idempotency.fingerprint('{"a": 1}'),
    'defaults: empty defaults change nothing'
);

-- fingerprint: fields --------------------------------------------------------------------------

SELECT is(
    idempotency.fingerprint('{"amount": 5, "trace_id": "t-1"}', fields => ARRAY['amount']),
    idempotency.fingerprint('{"amount": 5, "trace_id": "t-2"}', fields => ARRAY['amount']),
    'fields: a field not selected does not change the fingerprint'
);
SELECT is(
    idempotency.fingerprint('{"amount": 5, "trace_id": "t-1"}', fields => ARRAY['amount']),
    idempotency.fingerprint('{"amount": 5}'),
    'fields: only the selected fields are hashed'
);
SELECT isnt(
    idempotency.fingerprint('{"amount": 5, "trace_id": "t-1"}', fields => ARRAY['amount']),
    idempotency.fingerprint('{"amount": 6, "trace_id": "t-1"}', fields => ARRAY['amount']),
    'fields: a selected field that changes changes the fingerprint'
);
SELECT is(
    idempotency.fingerprint('{"amount": 5}', fields => ARRAY['amount', 'missing']),
    idempotency.fingerprint('{"amount": 5}'),
    'fields: a selected field the request lacks is simply absent'
);
SELECT is(
    idempotency.fingerprint('{"a": {"b": 1}, "b": 2}', fields => ARRAY['b']),
    idempotency.fingerprint('{"b": 2}'),
    'fields: selects top-level fields only (a nested "b" is not selected)'
);
SELECT is(
    idempotency.fingerprint('{"a": 1}', fields => ARRAY[]::text[]),
    idempotency.fingerprint('{}'),
    'fields: an empty list keeps nothing'
);
SELECT is(
    idempotency.fingerprint(
        '{"amount": 5, "ts": "12:00"}', defaults => '{"currency": "EUR"}',
        fields => ARRAY['amount', 'currency']
    ),
    idempotency.fingerprint('{"amount": 5, "currency": "EUR"}'),
    'fields are selected after the defaults are applied'
);

-- derive_key -----------------------------------------------------------------------------------

SELECT is(
    idempotency.derive_key('tenant-1', 'order-42', 'charge'),
    'd450cbc8cd623b1a1c787219fdac64f20b382036623ee3141cdbce44db9d3b61',
    'derive_key: a known vector, sha256 of ["tenant-1","order-42","charge"]'
);
SELECT is(
    idempotency.derive_key('tenant-1', 'order-42', 'charge'),
    idempotency.derive_key('tenant-1', 'order-42', 'charge'),
    'derive_key is deterministic'
);
SELECT isnt(
    idempotency.derive_key('tenant-1', 'order-42', 'charge'),
    idempotency.derive_key('tenant-1', 'order-42', 'refund'),
    'derive_key differs per step'
);
SELECT isnt(
    idempotency.derive_key('tenant-1', 'order-42', 'charge'),
    idempotency.derive_key('tenant-2', 'order-42', 'charge'),
    'derive_key differs per scope'
);
SELECT isnt(
    idempotency.derive_key('tenant-1', 'order-42', 'charge'),
    idempotency.derive_key('tenant-1', 'order-43', 'charge'),
    'derive_key differs per key'
);
SELECT isnt(
    idempotency.derive_key('a', 'b:c', 'd'),
    idempotency.derive_key('a:b', 'c', 'd'),
    'derive_key: moving characters between scope and key gives another key'
);
SELECT matches(
    idempotency.derive_key('s', 'k', 'step'), '^[0-9a-f]{64}$',
    'derive_key: 64 lower-case hex characters'
);
SELECT is_empty(
    $$SELECT FROM (VALUES ('s', 'k', 'step'), ('tenant "1"', 'o\\42', 'ü/😀'),
                          ('x', repeat('k', 255), 'y')) AS t (sc, k, st)
      WHERE idempotency.derive_key(sc, k, st) IS DISTINCT FROM
            encode(sha256(convert_to(idempotency.canonical_json(
                jsonb_build_array(sc, k, st)), 'UTF8')), 'hex')$$,
    'derive_key = hex(sha256(canonical_json(jsonb_build_array(scope, key, step))))'
);

SELECT * FROM finish();

ROLLBACK;
