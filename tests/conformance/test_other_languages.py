"""docs/other-languages.md: its psql, Node, Go, Java and Ruby examples are files that run here,
shown unchanged.

A fenced block right after ``<!-- file: PATH -->`` must be the file at PATH, byte for byte;
the psql example then runs with plain psql (twice: the second run replays), the others
through a check program beside them (node/payment_check.mjs, go/payment/check.go,
java/PaymentCheck.java, ruby/payment_check.rb), on PostgreSQL 15 and 18. The Go and Java ones
are compiled first (cached under build/conformance/).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import psycopg
import pytest

from conformance import HERE, NODE_DIR, langs, node_command
from pgharness import WAIT_BOUND, PgServer

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "other-languages.md"
INCLUDED = re.compile(r"<!-- file: (\S+) -->\n```\w*\n(.*?)```\n", re.S)
PSQL_EXAMPLE = ROOT / "tests" / "conformance" / "psql" / "payment.psql"
NODE_EXAMPLE = NODE_DIR / "payment.mjs"
GO_EXAMPLE = HERE / "go" / "payment" / "payment.go"
JAVA_EXAMPLE = HERE / "java" / "Payment.java"
RUBY_EXAMPLE = HERE / "ruby" / "payment.rb"
DONE = "payment example: 201, replay, 422, 409 as documented"


def test_doc_shows_the_executed_files_unchanged() -> None:
    text = DOC.read_text(encoding="utf-8")
    shown = dict(INCLUDED.findall(text))
    assert text.count("<!-- file: ") == len(shown), "a file marker without its code block"
    for path in (PSQL_EXAMPLE, NODE_EXAMPLE, GO_EXAMPLE, JAVA_EXAMPLE, RUBY_EXAMPLE):
        rel = str(path.relative_to(ROOT))
        assert rel in shown, f"{DOC.name} does not show {rel}"
    for rel, block in shown.items():
        assert block == (ROOT / rel).read_text(encoding="utf-8"), (
            f"{DOC.name} shows an old copy of {rel}: paste the file again")


def test_readme_links_other_languages() -> None:
    assert "(docs/other-languages.md)" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_psql_example(server: PgServer, db: str) -> None:
    # The script makes no table (the owner does, docs/other-languages.md): without it, it
    # stops at its INSERT.
    args = ("-X", "-q", "-v", "ON_ERROR_STOP=1", "-v", "scope=acct_0", "-v", "key=k")
    missing = server.run_psql(db, PSQL_EXAMPLE, args=args, check=False)
    assert missing.returncode != 0
    assert 'relation "charges" does not exist' in missing.stderr
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute("CREATE TABLE charges (id bigserial PRIMARY KEY, account text NOT NULL,"
                     " amount integer NOT NULL)")
    args = ("-X", "-q", "-v", "ON_ERROR_STOP=1", "-v", "scope=acct_42", "-v", "key=order-7f3a")
    first = server.run_psql(db, PSQL_EXAMPLE, args=args).stdout.splitlines()
    assert first == ["claim: claimed", "completed: 201 /charges/1",
                     'retry: replay 201 {"id": 1, "amount": 50}', "other request: mismatch"]
    second = server.run_psql(db, PSQL_EXAMPLE, args=args).stdout.splitlines()
    assert second == ["claim: replay", *first[2:]]
    with psycopg.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM charges").fetchone() == (1,)


@pytest.mark.node
def test_node_example(db: str) -> None:
    proc = subprocess.run([*node_command("payment_check.mjs"), db],
                          capture_output=True, text=True, timeout=WAIT_BOUND, cwd=NODE_DIR)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == [DONE]


def _check(argv: list[str]) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=WAIT_BOUND, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == [DONE]


@pytest.mark.go
def test_go_example(db: str) -> None:
    binary = langs.go_binary("payment", [GO_EXAMPLE, GO_EXAMPLE.with_name("check.go")])
    _check([str(binary), db])


@pytest.mark.jvm
def test_java_example(db: str) -> None:
    url = re.sub(r"^postgresql://([^@/]+)@([^/]+)/(.*)$", r"jdbc:postgresql://\2/\3?user=\1", db)
    assert url.startswith("jdbc:"), db
    _check([*langs.java_command("PaymentCheck", [JAVA_EXAMPLE,
                                                 JAVA_EXAMPLE.with_name("PaymentCheck.java")]),
            url])


@pytest.mark.ruby
def test_ruby_example(db: str) -> None:
    _check([langs.need("ruby", "ruby"), str(RUBY_EXAMPLE.with_name("payment_check.rb")), db])
