// The fingerprint vectors (tests/vectors/fingerprint.json) from Go: for each one, SHA-256 of
// the canonical text computed here, idempotency.fingerprint and canonical_json from the
// database, and derive_key, must all give the committed values.
//
//	vectors VECTORS.json DSN      (prints a count line; exit 1 on a mismatch)
package main

import (
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"

	_ "github.com/lib/pq"
)

type fingerprintVector struct {
	Name      string    `json:"name"`
	Request   string    `json:"request"`
	Defaults  *string   `json:"defaults"`
	Fields    *[]string `json:"fields"`
	Canonical string    `json:"canonical"`
	SHA256Hex string    `json:"sha256_hex"`
}

type deriveVector struct {
	Name, Scope, Key, Step, Derived string
}

func main() {
	data, err := os.ReadFile(os.Args[1])
	if err != nil {
		panic(err)
	}
	var vectors struct {
		Fingerprint []fingerprintVector `json:"fingerprint"`
		DeriveKey   []deriveVector      `json:"derive_key"`
	}
	if err := json.Unmarshal(data, &vectors); err != nil {
		panic(err)
	}
	db, err := sql.Open("postgres", os.Args[2]+"?sslmode=disable") // loopback, no TLS
	if err != nil {
		panic(err)
	}
	defer db.Close()
	var failures []string
	for _, v := range vectors.Fingerprint {
		sum := sha256.Sum256([]byte(v.Canonical))
		if local := hex.EncodeToString(sum[:]); local != v.SHA256Hex {
			failures = append(failures, v.Name+": sha256 here "+local)
		}
		var fields any
		if v.Fields != nil {
			text, _ := json.Marshal(*v.Fields)
			fields = string(text)
		}
		var defaults any
		if v.Defaults != nil {
			defaults = *v.Defaults
		}
		var digest string
		err := db.QueryRow(`SELECT encode(idempotency.fingerprint(request => $1::jsonb,
		        defaults => coalesce($2::jsonb, '{}'),
		        fields => CASE WHEN $3::jsonb IS NOT NULL
		                       THEN ARRAY(SELECT jsonb_array_elements_text($3::jsonb)) END), 'hex')`,
			v.Request, defaults, fields).Scan(&digest)
		if err != nil || digest != v.SHA256Hex {
			failures = append(failures, fmt.Sprintf("%s: fingerprint %s %v", v.Name, digest, err))
		}
		if v.Defaults != nil || v.Fields != nil {
			continue
		}
		var canonical string
		err = db.QueryRow("SELECT idempotency.canonical_json($1::jsonb)", v.Request).Scan(&canonical)
		if err != nil || canonical != v.Canonical {
			failures = append(failures, fmt.Sprintf("%s: canonical_json %s %v", v.Name, canonical, err))
		}
	}
	for _, v := range vectors.DeriveKey {
		var derived string
		err := db.QueryRow("SELECT idempotency.derive_key(scope => $1, key => $2, step => $3)",
			v.Scope, v.Key, v.Step).Scan(&derived)
		if err != nil || derived != v.Derived {
			failures = append(failures, fmt.Sprintf("%s: derive_key %s %v", v.Name, derived, err))
		}
	}
	for _, f := range failures {
		fmt.Fprintln(os.Stderr, f)
	}
	fmt.Printf("vectors: %d fingerprint, %d derive_key, %d failed\n",
		len(vectors.Fingerprint), len(vectors.DeriveKey), len(failures))
	if len(failures) > 0 {
		os.Exit(1)
	}
}
