"""The examples of README.md, docs/flask.md, docs/django.md and docs/sqlalchemy.md, run as
written.

Each test takes the code and command blocks from the page itself and follows it as a new user
would, on a real server: the schema's owner (``payments_owner``, owner of the database
``payments``) installs the engine and runs the page's ``owner.sql``; the application then runs
as the least-privilege role that file makes (``payments_api``: the engine's functions and the
rows of its tables, no CREATE), served by the command the page gives (``flask --app app.py
run``, ``python manage.py runserver``, ``python examples/fastapi_sqlalchemy/app.py``), and the
page's ``curl`` is sent twice. What the tests change, and why:

- the connection's host and port come from libpq's PGHOST and PGPORT (the pages name
  ``localhost`` and leave the port out), the server being the harness's;
- each server listens on a free port (FLASK_RUN_PORT, runserver's address argument, PORT),
  and the ``curl`` lines are pointed at it instead of 5000, 8000 or 8001.
"""

from __future__ import annotations

import ast
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from pgharness import WAIT_BOUND, PgServer

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
VENV_BIN = Path(sys.executable).parent
FENCE = re.compile(r"^```(\w*)\n(.*?)^```[ \t]*$", re.M | re.S)
# Far beyond need (seconds): an app starts in one or two on an idle machine, but make test
# runs on busy ones. The harness's one bound for waits (IDEM_TEST_WAIT_BOUND).
BOUND = WAIT_BOUND
OWNER, APP, DB = "payments_owner", "payments_api", "payments"


def block(doc: str, lang: str, containing: str) -> str:
    """The one fenced block of docs/DOC in language ``lang`` ('' for a bare fence) that
    contains ``containing`` (that starts with it, given as ``^text``)."""
    found = [m.group(2) for m in FENCE.finditer((DOCS / doc).read_text())
             if m.group(1) == lang and (m.group(2).startswith(containing[1:])
                                        if containing.startswith("^")
                                        else containing in m.group(2))]
    assert len(found) == 1, f"docs/{doc}: {len(found)} ```{lang} blocks with {containing!r}"
    return found[0]


def indented_block(doc: str, containing: str) -> str:
    """The one indented (4 spaces) code block of docs/DOC that contains ``containing``."""
    found = [re.sub(r"^    ", "", m.group(0), flags=re.M)
             for m in re.finditer(r"(?:^    \S.*\n)+", (DOCS / doc).read_text(), re.M)
             if containing in m.group(0)]
    assert len(found) == 1, f"docs/{doc}: {len(found)} indented blocks with {containing!r}"
    return found[0]


def logical_lines(commands: str) -> list[str]:
    """Shell lines with their backslash continuations joined."""
    return re.sub(r"\\\n\s*", " ", commands).strip().splitlines()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def shell_env(server: PgServer, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PG", "DJANGO", "FLASK")) and k not in ("DATABASE_URL", "PORT")}
    env.update(PATH=f"{VENV_BIN}:{server.bindir}:{env.get('PATH', '/usr/bin:/bin')}",
               PGHOST="localhost", PGPORT=str(server.port), LC_ALL="C", **extra)
    return env


def sh(commands: str, cwd: Path, env: dict[str, str]) -> str:
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", commands], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=BOUND,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"{commands}\n{done.stdout}\n{done.stderr}"
    return done.stdout


@contextmanager
def serving(command: str, cwd: Path, env: dict[str, str], port: int,
            log: Path) -> Iterator[None]:
    """Run ``command`` (a shell line) until the block ends; first wait until it accepts
    connections on ``port``."""
    with log.open("w") as out:
        proc = subprocess.Popen(["bash", "-c", command], cwd=cwd, env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        started = time.monotonic()
        while True:
            if proc.poll() is not None:
                pytest.fail(f"{command!r} exited {proc.returncode}:\n{log.read_text()}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
                break
            except OSError:
                if time.monotonic() - started > BOUND:
                    pytest.fail(f"{command!r} did not listen on {port} in {BOUND} s:\n"
                                f"{log.read_text()}")
                time.sleep(0.2)
        yield
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(BOUND)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def curl(command: str, cwd: Path, env: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    """Run a ``curl -i`` line: (status, headers with lower-case names, body bytes)."""
    done = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True,
                          timeout=BOUND, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    head, _, body = done.stdout.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers, body


def query(server: PgServer, text: str, user: str = OWNER) -> list[tuple]:
    with psycopg.connect(server.dsn(DB, user=user)) as conn:
        return conn.execute(text).fetchall()


@pytest.fixture
def payments(server: PgServer) -> Iterator[PgServer]:
    """The database ``payments`` owned by ``payments_owner`` (LOGIN CREATEROLE), as the pages
    assume; no ``payments_api`` yet (the pages make it). Removed afterwards, roles too."""
    def reset() -> None:
        with psycopg.connect(server.dsn("postgres"), autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(DB)))
            for role in (APP, OWNER):  # the application role first: the owner made it
                conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))

    reset()
    # docs/install.md, "A database to try it in", as the superuser; one statement at a time
    # (CREATE DATABASE cannot run in the implicit transaction of a multi-statement query).
    superuser = block("install.md", "sql", "^CREATE ROLE payments_owner")
    statements = [s.strip() for s in superuser.split(";") if s.strip()]
    assert len(statements) == 2, statements
    with psycopg.connect(server.dsn("postgres"), autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)
    try:
        yield server
    finally:
        reset()


def assert_least_privilege(server: PgServer) -> None:
    """payments_api can create nothing in the database, and the app ran as it."""
    (row,) = query(server, f"SELECT has_schema_privilege('{APP}', 'public', 'CREATE'), "
                           f"has_database_privilege('{APP}', '{DB}', 'CREATE'), "
                           f"(SELECT rolsuper OR rolcreaterole FROM pg_roles "
                           f" WHERE rolname = '{APP}')")
    assert row == (False, False, False)


def assert_replayed(first: tuple, second: tuple) -> None:
    assert first[0] == 201, first
    assert second[0] == 201 and second[2] == first[2], (first, second)
    assert second[1].get("idempotent-replayed") == "true", second[1]
    assert "idempotent-replayed" not in first[1]
    assert second[1].get("location") == first[1].get("location") is not None


@pytest.mark.parametrize("server", ["pg18"], indirect=True)
def test_flask_page(payments: PgServer, tmp_path: Path) -> None:
    server = payments
    env = shell_env(server)
    (tmp_path / "owner.sql").write_text(block("flask.md", "sql", "CREATE ROLE payments_api"))
    sh(block("flask.md", "", "pg-idempotency migrate"), tmp_path, env)
    (tmp_path / "app.py").write_text(block("flask.md", "python", "def create_app("))
    run, *curl_lines = logical_lines(block("flask.md", "", "flask --app app.py run"))
    assert run.endswith("flask --app app.py run") and len(curl_lines) == 1, run
    port = free_port()
    pay = curl_lines[0].replace("localhost:5000", f"localhost:{port}")
    assert pay != curl_lines[0]
    with serving(run, tmp_path, shell_env(server, FLASK_RUN_PORT=str(port)), port,
                 tmp_path / "flask.log"):
        first, second = curl(pay, tmp_path, env), curl(pay, tmp_path, env)
        other = curl(pay.replace('"amount": 50', '"amount": 51'), tmp_path, env)
        # A client's mistakes are answered 4xx by the page's view, never 500; under new keys.
        mistakes = {body: curl(pay.replace("order-7f3a", f"bad-{n}").replace(
                        "'{\"amount\": 50, \"currency\": \"EUR\"}'", f"'{body}'"),
                        tmp_path, env)[0]
                    for n, body in enumerate(['[1]', 'null', '{"amount": true}',
                                              '{"amount": 99999999999}', '{"amount": 5.5}',
                                              '{"amount": 5, "currency": ["EUR"]}',
                                              '{"amount": 5, "currency": "E\\u0000R"}',
                                              '{"amount"'])}
        (sessions,) = query(server, "SELECT count(*) FROM pg_stat_activity "
                                    f"WHERE usename = '{APP}' AND datname = '{DB}'")[0]
    assert_replayed(first, second)
    assert other[0] == 422, other
    assert mistakes == {**dict.fromkeys(list(mistakes)[:-1], 422), '{"amount"': 400}, mistakes
    assert sessions >= 1  # the app's pool connected as the application role
    assert query(server, "SELECT account, amount, currency FROM ledger") == [
        ("acct_42", 50, "EUR")]
    assert_least_privilege(server)


@pytest.mark.parametrize("server", ["pg18"], indirect=True)
def test_django_page(payments: PgServer, tmp_path: Path) -> None:
    server = payments
    env = shell_env(server)
    sh(block("django.md", "", "django-admin startproject"), tmp_path, env)
    project = tmp_path / "payments_site"
    settings = project / "payments_site" / "settings.py"
    generated = settings.read_text()
    # startproject's default middleware, whose CSRF check the page's @csrf_exempt is about
    assert "django.middleware.csrf.CsrfViewMiddleware" in generated
    settings.write_text(generated + "\n" + block("django.md", "python", "INSTALLED_APPS +="))
    (project / "ledger" / "models.py").write_text(
        block("django.md", "python", "class Receipt(models.Model)"))
    (project / "ledger" / "views.py").write_text(
        block("django.md", "python", "def create_payment(request)"))
    (project / "payments_site" / "urls.py").write_text(
        block("django.md", "python", 'urlpatterns = [path("payments/", create_payment)]'))
    owner_sql = block("django.md", "sql", "ALL TABLES IN SCHEMA public")
    (project / "owner.sql").write_text(owner_sql)
    sh(block("django.md", "", "makemigrations ledger"), project, env)

    run, *curl_lines = logical_lines(block("django.md", "", "^python manage.py runserver"))
    assert run == "python manage.py runserver" and len(curl_lines) == 1, run
    port = free_port()
    pay = curl_lines[0].replace("localhost:8000", f"localhost:{port}")
    assert pay != curl_lines[0]
    with serving(f"{run} 127.0.0.1:{port}", project, env, port, tmp_path / "django.log"):
        first, second = curl(pay, project, env), curl(pay, project, env)
        # A client's mistakes are answered 422 by the page's view, never 500; under new keys.
        body = "'{\"account\": \"alice\", \"amount\": \"12.50\"}'"
        assert body in pay
        mistakes = {bad: curl(pay.replace("Idempotency-Key: k1", f"Idempotency-Key: bad-{n}")
                              .replace(body, f"'{bad}'"), project, env)[0]
                    for n, bad in enumerate(['[1]', 'null', '{"amount"', '{"account": "a"}',
                                             '{"account": "a", "amount": "x"}',
                                             '{"account": "a", "amount": "1e30"}',
                                             '{"account": "a", "amount": "NaN"}',
                                             '{"account": "a", "amount": "0.001"}',
                                             '{"account": "a", "amount": -1}',
                                             '{"account": "a\\u0000", "amount": 1}',
                                             '{"account": 7, "amount": 1}'])}
    assert mistakes == dict.fromkeys(mistakes, 422), mistakes
    assert first[0] != 403, first  # CSRF
    assert_replayed(first, second)
    assert query(server, "SELECT count(*) FROM ledger_payment") == [(1,)]
    assert query(server, "SELECT count(*) FROM ledger_receipt") == [(1,)]
    assert_least_privilege(server)

    # The outbox: its model, the view's line, the worker, as the application role.
    outbox = block("django.md", "python", "class Outbox(models.Model)")
    model = outbox[:outbox.index("# in the view")]
    view_line = re.search(r"^#\s+(Outbox\.objects\.create\(.*\))$", outbox, re.M).group(1)
    worker = outbox[outbox.index("from django.db import transaction"):]
    with (project / "ledger" / "models.py").open("a") as f:
        f.write("\n\n" + model)
    (project / "ledger" / "outbox.py").write_text("from .models import Outbox\n\n" + worker)
    sh("PAYMENTS_DB_USER=payments_owner python manage.py makemigrations ledger && "
       "PAYMENTS_DB_USER=payments_owner python manage.py migrate", project, env)
    grant = next(line for line in owner_sql.splitlines() if line.startswith("GRANT"))
    query_autocommit(server, grant)  # "Tables of later migrations need the same GRANT"
    script = "\n".join([
        "from django.db import transaction",
        "from ledger.models import Outbox, Payment",
        "from ledger.outbox import deliver_outbox",
        "payment = Payment.objects.get()",
        "with transaction.atomic():",
        f"    {view_line}",
        "sent = []",
        "deliver_outbox(lambda *row: sent.append(row))",
        "deliver_outbox(lambda *row: sent.append(row))",
        "print(repr([(topic, payload) for _, topic, payload in sent]))",
        "print(Outbox.objects.filter(sent_at=None).count())",
    ])
    out = sh(f"python manage.py shell -c {quote(script)}", project, env).splitlines()
    (payment_id,) = query(server, "SELECT id FROM ledger_payment")[0]
    assert ast.literal_eval(out[-2]) == [("receipt", {"payment_id": payment_id})]
    assert out[-1] == "0"

    # "Testing your app": the TestCase with the mixin (the page's indented block, in
    # ledger/tests.py), run by the owner once a superuser gave it CREATEDB.
    testcase = re.search(r"^  ```python\n(.*?)^  ```", (DOCS / "django.md").read_text(),
                         re.M | re.S).group(1)
    assert "IdempotencyTestCaseMixin" in testcase
    (project / "ledger" / "tests.py").write_text(re.sub(r"^  ", "", testcase, flags=re.M))
    test_line = block("django.md", "", "manage.py test ledger").strip()
    refused = subprocess.run(["bash", "-c", test_line.replace("payments_owner", APP)],
                             cwd=project, env=env, capture_output=True, text=True,
                             timeout=BOUND, stdin=subprocess.DEVNULL)
    assert "permission denied to create database" in refused.stdout + refused.stderr
    with psycopg.connect(server.dsn("postgres"), autocommit=True) as conn:
        conn.execute(block("django.md", "sql", "CREATEDB"))
    done = subprocess.run(["bash", "-c", test_line], cwd=project, env=env,
                          capture_output=True, text=True, timeout=BOUND,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0 and "Ran 1 test" in done.stderr, done.stdout + done.stderr


def query_autocommit(server: PgServer, statement: str) -> None:
    with psycopg.connect(server.dsn(DB, user=OWNER), autocommit=True) as conn:
        conn.execute(statement)


def quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


@pytest.mark.parametrize("server", ["pg18"], indirect=True)
def test_sqlalchemy_page(payments: PgServer, tmp_path: Path) -> None:
    server = payments
    env = shell_env(server)
    example_path = ROOT / "examples" / "fastapi_sqlalchemy" / "app.py"
    example = set(example_path.read_text().splitlines())
    excerpt = block("sqlalchemy.md", "python", "OperationSession = Annotated")
    missing = [line for line in excerpt.splitlines() if line.strip() and line not in example]
    assert missing == [], "not lines of examples/fastapi_sqlalchemy/app.py"

    (tmp_path / "owner.sql").write_text(block("sqlalchemy.md", "sql", "sa_ledger"))
    lines = logical_lines(block("sqlalchemy.md", "", "python examples/fastapi_sqlalchemy"))
    run = next(line for line in lines if "python examples/" in line)
    pay_line = next(line for line in lines if line.startswith("curl"))
    sh("\n".join(lines[:lines.index(run)]), tmp_path, env)  # as the owner
    port = free_port()
    pay = pay_line.replace("localhost:8001", f"localhost:{port}")
    assert pay != pay_line
    with serving(run, ROOT, shell_env(server, PORT=str(port)), port, tmp_path / "app.log"):
        first, second = curl(pay, tmp_path, env), curl(pay, tmp_path, env)
        # A client's mistakes are 422 (the example's model), never 500; under new keys.
        body = "'{\"amount\": 50, \"currency\": \"EUR\"}'"
        assert body in pay
        mistakes = {bad: curl(pay.replace("order-7f3a", f"bad-{n}").replace(body, f"'{bad}'"),
                              tmp_path, env)[0]
                    for n, bad in enumerate(['[1]', '{"amount": true}', '{"amount": 5.5}',
                                             '{"amount": 99999999999}', '{"amount": -5}',
                                             '{"amount": 5, "currency": "E\\u0000R"}'])}
    assert mistakes == dict.fromkeys(mistakes, 422), mistakes
    assert_replayed(first, second)
    assert query(server, "SELECT account, amount FROM sa_ledger") == [("acct_42", 50)]

    # pay.py beside the example's app.py, as the page says
    (tmp_path / "app.py").write_text(example_path.read_text())
    (tmp_path / "pay.py").write_text(block("sqlalchemy.md", "python", "def pay(scope, key"))
    out = [ast.literal_eval(line)
           for line in sh("python pay.py", tmp_path, env).splitlines()]
    assert len(out) == 5 and out[0] == out[1] and out[2] == out[3], out
    assert [status for status, _ in out] == [201] * 5
    assert len({body["id"] for _, body in out}) == 3
    assert query(server, "SELECT count(*) FROM sa_ledger") == [(4,)]
    assert query(server, "SELECT key, state FROM idempotency.keys "
                         "WHERE key NOT LIKE 'bad-%' ORDER BY key") == [
        ("order-1", "completed"), ("order-2", "completed"), ("order-3", "completed"),
        ("order-7f3a", "completed")]
    # FastAPI refused those before the handler: not the key's result, so released.
    assert query(server, "SELECT DISTINCT state FROM idempotency.keys "
                         "WHERE key LIKE 'bad-%'") == [("released",)]
    assert_least_privilege(server)


def test_install_page_copies_the_installed_migrations(tmp_path: Path) -> None:
    """docs/install.md's copy of the files for Django RunSQL and Alembic, from the folder
    `pg-idempotency sql-path` prints."""
    commands = indented_block("install.md", "pg-idempotency sql-path")
    env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
    done = subprocess.run(["bash", "-euc", commands], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=BOUND)
    assert done.returncode == 0, done.stderr
    copied = sorted((tmp_path / "myapp" / "migrations" / "pg_idempotency_sql").glob("*.sql"))
    released = sorted((ROOT / "migrations").glob("*.sql"))
    assert [f.name for f in copied] == [f.name for f in released]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(copied, released, strict=True))


@pytest.mark.parametrize("server", ["pg18"], indirect=True)
def test_other_languages_psql_as_the_application_role(payments: PgServer,
                                                      tmp_path: Path) -> None:
    """docs/other-languages.md's psql example as written, as install.md's application role, on
    the table the page has the owner make: it pays once, replays, refuses another request."""
    server = payments
    env = shell_env(server)
    sh(f"pg-idempotency migrate --dsn 'postgresql://{OWNER}@localhost/{DB}'", tmp_path, env)
    query_autocommit(server, f"CREATE ROLE {APP} LOGIN")
    query_autocommit(server, f"SELECT idempotency.grant_usage('{APP}')")
    for statement in block("other-languages.md", "sql", "^CREATE TABLE charges").split(";"):
        if statement.strip():
            query_autocommit(server, statement)
    script = (ROOT / "tests" / "conformance" / "psql" / "payment.psql").read_text()
    assert not re.search(r"^\s*CREATE\b", script, re.M | re.I), "the script makes a table"
    (tmp_path / "payment.psql").write_text(script)
    run = (f"psql -X -q -v ON_ERROR_STOP=1 -v scope=acct_42 -v key=order-7f3a -f {{}} "
           f"'postgresql://{APP}@localhost/{DB}'")
    out = sh(run.format("payment.psql"), tmp_path, env).splitlines()
    assert out == ["claim: claimed", "completed: 201 /charges/1",
                   'retry: replay 201 {"id": 1, "amount": 50}', "other request: mismatch"], out
    assert_least_privilege(server)


def readme_block(lang: str) -> str:
    """The one fenced block of README.md in language ``lang``."""
    found = [m.group(2) for m in FENCE.finditer((ROOT / "README.md").read_text())
             if m.group(1) == lang]
    assert len(found) == 1, f"README.md: {len(found)} ```{lang} blocks"
    return found[0]


@pytest.mark.parametrize("server", ["pg18"], indirect=True)
def test_readme_patterns_as_the_application_role(payments: PgServer, tmp_path: Path) -> None:
    """README.md's two patterns as written, as install.md's application role, on the table the
    psql block's comment tells the owner to make: the Python one's pay() pays once and replays
    the second time; then (the key removed by the owner) the psql block, run by psql, books
    one row and completes the key with the claim's own lease_token."""
    server = payments
    env = shell_env(server)
    sh(f"pg-idempotency migrate --dsn 'postgresql://{OWNER}@localhost/{DB}'", tmp_path, env)
    query_autocommit(server, f"CREATE ROLE {APP} LOGIN")
    query_autocommit(server, f"SELECT idempotency.grant_usage('{APP}')")
    pattern = readme_block("sql")
    owner_lines = [line.removeprefix("--   ").split("--")[0]
                   for line in pattern.splitlines() if line.startswith("--   ")]
    assert [line.split()[0] for line in owner_lines] == ["CREATE", "GRANT"], owner_lines
    for statement in owner_lines:
        query_autocommit(server, statement)

    namespace: dict[str, object] = {}
    exec(compile(readme_block("python"), "README.md", "exec"), namespace)  # noqa: S102
    pay = namespace["pay"]
    assert callable(pay)
    with psycopg.connect(server.dsn(DB, user=APP), autocommit=True) as conn:
        assert pay(conn) == (201, {"id": "ch_1"})
        assert pay(conn) == (201, {"id": "ch_1"})  # the stored answer: no second row
    assert query(server, "SELECT account, amount FROM ledger") == [("acct_42", 50)]

    for statement in ("DELETE FROM idempotency.keys WHERE scope = 'acct_42'",
                      "DELETE FROM idempotency.key_directory WHERE scope = 'acct_42'",
                      "DELETE FROM ledger"):
        query_autocommit(server, statement)
    (tmp_path / "pattern.sql").write_text(pattern)
    sh(f"psql -X -q -v ON_ERROR_STOP=1 -f pattern.sql 'postgresql://{APP}@localhost/{DB}'",
       tmp_path, env)
    assert query(server, "SELECT account, amount FROM ledger") == [("acct_42", 50)]
    assert query(server, "SELECT state, response_status, response_headers->>'Location'"
                         " FROM idempotency.keys WHERE scope = 'acct_42'") == [
        ("completed", 201, "/charges/ch_1")]
    assert_least_privilege(server)
