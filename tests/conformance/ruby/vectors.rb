# frozen_string_literal: true

# The fingerprint vectors (tests/vectors/fingerprint.json) from Ruby: for each one, SHA-256 of
# the canonical text computed here, idempotency.fingerprint and canonical_json from the
# database, and derive_key, must all give the committed values.
#
#   ruby vectors.rb VECTORS.json DSN      (prints a count line; exit 1 on a mismatch)

require "digest"
require "json"
require "pg"

vectors = JSON.parse(File.read(ARGV.fetch(0), encoding: "UTF-8"))
conn = PG.connect(ARGV.fetch(1))
failures = []
vectors["fingerprint"].each do |v|
  name = v["name"]
  local = Digest::SHA256.hexdigest(v["canonical"].encode("UTF-8"))
  failures << "#{name}: sha256 here #{local}" unless local == v["sha256_hex"]
  fields = v["fields"] && JSON.generate(v["fields"])
  digest = conn.exec_params(<<~SQL, [v["request"], v["defaults"], fields]).getvalue(0, 0)
    SELECT encode(idempotency.fingerprint(request => $1::jsonb,
        defaults => coalesce($2::jsonb, '{}'),
        fields => CASE WHEN $3::jsonb IS NOT NULL
                       THEN ARRAY(SELECT jsonb_array_elements_text($3::jsonb)) END), 'hex')
  SQL
  failures << "#{name}: fingerprint #{digest}" unless digest == v["sha256_hex"]
  next if v.key?("defaults") || v.key?("fields")

  canonical = conn.exec_params("SELECT idempotency.canonical_json($1::jsonb)", [v["request"]]).getvalue(0, 0)
  failures << "#{name}: canonical_json #{canonical}" unless canonical == v["canonical"]
end
vectors["derive_key"].each do |v|
  derived = conn.exec_params("SELECT idempotency.derive_key(scope => $1, key => $2, step => $3)",
                             [v["scope"], v["key"], v["step"]]).getvalue(0, 0)
  failures << "#{v['name']}: derive_key #{derived}" unless derived == v["derived"]
end
conn.close
failures.each { |f| warn f }
puts "vectors: #{vectors['fingerprint'].size} fingerprint, #{vectors['derive_key'].size} derive_key, " \
     "#{failures.size} failed"
exit(failures.empty? ? 0 : 1)
