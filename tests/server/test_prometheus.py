"""idempotency.metrics() and its Prometheus side, the way operators run it: keys put in known
states, the gauges read in SQL, then scraped through Debian's prometheus-postgres-exporter
(started here on loopback with monitoring/postgres-exporter-queries.yaml, connected as a
'monitor' role), and the alert rules of monitoring/alerts.yml run through promtool.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers import login_roles
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from pgharness import WAIT_BOUND, PgServer, free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "monitoring"
EXPORTER = "/usr/bin/prometheus-postgres-exporter"
PROMTOOL = "/usr/bin/promtool"
SCOPE = "ops"
HOURS_AGO = 2


def make_keys(conn: psycopg.Connection[Any]) -> dict[str, int]:
    """Two completed keys, one in progress with a live lease, one whose lease expired
    HOURS_AGO hours ago less a minute (claimed HOURS_AGO hours ago with a one-minute lease),
    one released (its row stays, in state released, until its next claim)."""
    tokens = {}
    for key in ("done1", "done2", "live", "gone"):
        tokens[key] = conn.execute(
            "SELECT lease_token FROM idempotency.claim(%s, %s, %s, lease => '1 hour')",
            (SCOPE, key, Jsonb({"k": key}))).fetchone()[0]
    for key in ("done1", "done2"):
        conn.execute("SELECT idempotency.complete(%s, %s, %s, 201, '{}')",
                     (SCOPE, key, tokens[key]))
    conn.execute("SELECT idempotency.release(%s, 'gone', %s)", (SCOPE, tokens["gone"]))
    past = datetime.now(timezone.utc) - timedelta(hours=HOURS_AGO)
    tokens["dead"] = conn.execute(
        "SELECT lease_token FROM idempotency.claim(%s, 'dead', '{}', lease => '1 minute', "
        "reference_time => %s)", (SCOPE, past)).fetchone()[0]
    return tokens


def metrics(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute("SELECT * FROM idempotency.metrics()").fetchone()


def test_metrics_of_keys_in_known_states(server: PgServer, db: str) -> None:
    with psycopg.connect(db, autocommit=True) as conn:
        before = metrics(conn)
        assert before["keys_in_progress"] == 0 and before["keys_expired_leases"] == 0
        assert before["oldest_in_progress_age_seconds"] is None
        assert before["maintain_last_outcome"] is None  # the template never ran maintain()
        assert before["partitions_ahead"] == before["premake"] == 3
        assert before["total_bytes"] > 0
        make_keys(conn)
        m = metrics(conn)
        assert m["keys_in_progress"] == 2
        assert m["keys_expired_leases"] == 1
        assert m["keys_released"] == 1
        assert abs(m["oldest_in_progress_age_seconds"] - HOURS_AGO * 3600) < 60
        assert abs(m["oldest_expired_lease_age_seconds"] - (HOURS_AGO * 3600 - 60)) < 60
        # The statistics collector's counts trail the commits by up to a second or so.
        def counted() -> dict[str, Any] | None:
            now = metrics(conn)
            return now if now["keys_total_estimate"] == 5 else None

        m = wait_until(counted, "keys_total_estimate to reach 5")
        assert m["keys_completed_estimate"] == 2  # neither in progress nor released
        assert conn.execute("SELECT * FROM idempotency.metrics_by_scope()").fetchall() == [
            (SCOPE, 2, 1, pytest.approx(HOURS_AGO * 3600, abs=60), 1)]

        # maintain() records its run; metrics() reports it.
        steps = conn.execute("SELECT count(*) FROM idempotency.maintain()").fetchone()[0]
        m = metrics(conn)
        assert m["maintain_last_outcome"] == "ok"
        assert 0 <= m["maintain_last_run_age_seconds"] < 60
        assert 0 <= m["maintain_last_duration_seconds"] < 60
        assert m["maintain_last_created"] + m["maintain_last_dropped"] <= steps
        assert 0 < m["next_drop_seconds"] < 3 * 86400

        # A run while another holds the maintenance lock is recorded as skipped.
        with psycopg.connect(db) as other:
            other.execute("SELECT pg_advisory_xact_lock(3, 0)")
            assert conn.execute("SELECT action FROM idempotency.maintain()").fetchall() == [
                ("skipped",)]
            other.rollback()
        assert metrics(conn)["maintain_last_outcome"] == "skipped"
        # scan => false: no pass over the keys, the exact gauges are NULL, the rest is there.
        with conn.cursor(row_factory=dict_row) as cur:
            cheap = cur.execute("SELECT * FROM idempotency.metrics(scan => false)").fetchone()
        assert cheap["keys_in_progress"] is None and cheap["keys_completed_estimate"] is None
        assert cheap["keys_released"] is None
        assert cheap["partitions_ahead"] == 3 and cheap["maintain_last_outcome"] == "skipped"
        with pytest.raises(psycopg.Error) as info:
            conn.execute("SELECT idempotency.metrics(scan => NULL)")
        assert info.value.sqlstate == "IK010" and '"scan"' in str(info.value)
        assert conn.execute("SELECT outcome FROM idempotency.maintenance_runs ORDER BY id"
                            ).fetchall() == [("ok",), ("skipped",)]


def test_a_monitor_role_reads_metrics_and_nothing_else(server: PgServer, db: str) -> None:
    with login_roles(server, db, "monitor") as (role,), \
            psycopg.connect(db, user=role, autocommit=True) as conn:
        assert metrics(conn)["keys_in_progress"] == 0
        for query, sqlstate in (
            ("SELECT idempotency.claim('s', 'k', '{}')", "42501"),
            ("SELECT count(*) FROM idempotency.keys", "42501"),
            ("SELECT count(*) FROM idempotency.key_status()", "42501"),
            # Moving the clock is the owner's (tests') alone (docs/errors.md).
            ("SELECT idempotency.metrics(reference_time => now())", "IK017"),
        ):
            with pytest.raises(psycopg.Error) as info:
                conn.execute(query)
            assert info.value.sqlstate == sqlstate, query


# -- the postgres exporter ---------------------------------------------------------------------

def need(path: str) -> None:
    if not os.access(path, os.X_OK):
        pytest.fail(f"{path} is missing: make setup installs it (Makefile DEB_PKGS)")


@contextlib.contextmanager
def exporter(dsn: str, tmp: Path) -> Iterator[str]:
    need(EXPORTER)
    port = free_port()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "DATA_SOURCE_NAME": dsn}
    log = (tmp / "exporter.log").open("w")
    proc = subprocess.Popen(
        [EXPORTER, f"--web.listen-address=127.0.0.1:{port}",
         f"--extend.query-path={MONITORING / 'postgres-exporter-queries.yaml'}",
         "--disable-default-metrics", "--disable-settings-metrics"],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        deadline = time.monotonic() + WAIT_BOUND
        while True:
            try:
                urllib.request.urlopen(url, timeout=5).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError("the exporter did not answer:\n"
                                         + (tmp / "exporter.log").read_text()[-3000:]) from None
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


SAMPLE_RE = re.compile(r"^(pg_idempotency\w*)(\{[^}]*\})? (\S+)$", re.M)


def scrape(url: str) -> dict[str, dict[str, float]]:
    """{metric name: {label text: value}} of our metrics."""
    text = urllib.request.urlopen(url, timeout=WAIT_BOUND).read().decode()
    out: dict[str, dict[str, float]] = {}
    for name, labels, value in SAMPLE_RE.findall(text):
        out.setdefault(name, {})[labels] = float(value)
    return out


def one(samples: dict[str, dict[str, float]], name: str, label: str = "") -> float:
    values = [v for labels, v in samples.get(name, {}).items() if label in labels]
    assert len(values) == 1, f"{name}{{{label}}}: {samples.get(name)}"
    return values[0]


@pytest.mark.prometheus
def test_the_postgres_exporter_scrapes_our_metrics(
    server: PgServer, db: str, tmp_path: Path
) -> None:
    with psycopg.connect(db, autocommit=True) as conn:
        tokens = make_keys(conn)
    with login_roles(server, db, "monitor") as (role,):
        dsn = db.replace("postgres@", f"{role}@", 1) + "?sslmode=disable"
        with exporter(dsn, tmp_path) as url:
            s = scrape(url)
            assert one(s, "pg_idempotency_keys_in_progress") == 2
            assert one(s, "pg_idempotency_keys_expired_leases") == 1
            assert one(s, "pg_idempotency_keys_released") == 1
            assert one(s, "pg_idempotency_keys_oldest_expired_lease_age_seconds"
                       ) == pytest.approx(HOURS_AGO * 3600 - 60, abs=120)
            assert one(s, "pg_idempotency_partitions_ahead") == 3
            assert one(s, "pg_idempotency_premake") == 3
            assert one(s, "pg_idempotency_total_bytes") > 0
            assert one(s, "pg_idempotency_maintain_last_run_age_seconds",
                       'outcome="never"') == float("inf")
            # Per scope, hashed: the first 12 hex digits of sha256(scope), never the scope.
            scope_hash = hashlib.sha256(SCOPE.encode()).hexdigest()[:12]
            assert one(s, "pg_idempotency_scope_keys_in_progress",
                       f'scope_hash="{scope_hash}"') == 2
            raw = urllib.request.urlopen(url, timeout=WAIT_BOUND).read().decode()
            assert f'"{SCOPE}"' not in raw and "scope=" not in raw

        # The metrics move: a completer takes the expired key over and finishes it, the live
        # one completes, maintain() runs. A new exporter process: the scan-based queries are
        # cached for 60 s (cache_seconds) in the one that scraped already.
        with psycopg.connect(db, autocommit=True) as conn:
            token = conn.execute("SELECT lease_token FROM idempotency.takeover(%s, 'dead')",
                                 (SCOPE,)).fetchone()[0]
            conn.execute("SELECT idempotency.complete(%s, 'dead', %s, 200, '{}')",
                         (SCOPE, token))
            conn.execute("SELECT idempotency.complete(%s, 'live', %s, 200, '{}')",
                         (SCOPE, tokens["live"]))
            conn.execute("SELECT count(*) FROM idempotency.maintain()")
        with exporter(dsn, tmp_path) as url:
            s = scrape(url)
            assert one(s, "pg_idempotency_keys_in_progress") == 0
            assert one(s, "pg_idempotency_keys_expired_leases") == 0
            assert one(s, "pg_idempotency_keys_oldest_in_progress_age_seconds") == 0
            assert one(s, "pg_idempotency_maintain_last_run_age_seconds",
                       'outcome="ok"') < 60
            assert "pg_idempotency_scope_keys_in_progress" not in s


@pytest.mark.prometheus
def test_the_exporter_follows_the_retry_storm_demo(
    server: PgServer, db: str, tmp_path: Path
) -> None:
    """`make run`'s retry storm (tools/run.py: install, then `pg-idempotency demo`), small,
    against this test's database, with one exporter scraped before, during and after it, and a
    second one after maintain(): the gauges move and end at the values SQL counts."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import run  # tools/run.py, what `make run` runs
    finally:
        sys.path.remove(str(ROOT / "tools"))
    counts = ("SELECT count(*), count(*) FILTER (WHERE state = 'in_progress'), "
              "count(*) FILTER (WHERE state = 'released') FROM idempotency.keys")
    with login_roles(server, db, "monitor") as (role,):
        dsn = db.replace("postgres@", f"{role}@", 1) + "?sslmode=disable"
        first_scrape = time.monotonic()  # no earlier than the exporter's first (cached) scan
        with exporter(dsn, tmp_path) as url:
            before = scrape(url)
            assert one(before, "pg_idempotency_keys_total_estimate") == 0
            assert one(before, "pg_idempotency_keys_completed_estimate") == 0
            assert one(before, "pg_idempotency_keys_in_progress") == 0
            assert one(before, "pg_idempotency_maintain_last_run_age_seconds",
                       'outcome="never"') == float("inf")

            run.install(db)
            summary = tmp_path / "storm.json"
            codes: list[int] = []
            storm = threading.Thread(target=lambda: codes.append(run.demo(
                db, ["--clients", "2", "--payments", "10", "--seed", "6", "--json"],
                stdout=summary)))
            storm.start()
            during = []
            while storm.is_alive():
                during.append(scrape(url))
                time.sleep(0.3)
            storm.join()
            assert codes == [0], (tmp_path / "storm.json").read_text()
            protected = json.loads(summary.read_text())["protected"]
            assert protected["intents"] == 20
            assert protected["duplicate_charges"] == protected["lost_payments"] == 0

            with psycopg.connect(db, autocommit=True) as conn:
                keys, in_progress, released = conn.execute(counts).fetchone()
            assert keys == protected["intents"]  # one key per payment on the protected side
            # The uncached gauge catches up with the table once the statistics are flushed.
            def caught_up() -> dict[str, dict[str, float]] | None:
                now = scrape(url)
                return now if one(now, "pg_idempotency_keys_total_estimate") == keys else None

            after = wait_until(caught_up, f"pg_idempotency_keys_total_estimate = {keys}")
            cache_age = time.monotonic() - first_scrape
            totals = [one(s, "pg_idempotency_keys_total_estimate")
                      for s in (before, *during, after)]
            assert len(during) >= 2, totals
            assert totals[-1] == keys, totals
            assert totals == sorted(totals), totals  # keys are only added in the storm
            assert any(0 < t < keys for t in totals[1:-1]), totals  # seen mid-storm
            # The scan-based gauges are cached for 60 s (cache_seconds): this process still
            # shows what its first scrape saw. On a machine loaded enough that the storm took
            # longer than that, the cache may have expired: then it shows the table.
            completed = one(after, "pg_idempotency_keys_completed_estimate")
            if cache_age < 55:
                assert completed == 0, completed
            else:
                print(f"cache older than its 60 s ({cache_age:.0f} s): completed {completed}")
                assert completed in (0, keys - in_progress - released), completed

        with psycopg.connect(db, autocommit=True) as conn:
            steps = conn.execute("SELECT count(*) FROM idempotency.maintain()").fetchone()[0]
            m = metrics(conn)
            assert conn.execute(counts).fetchone() == (keys, in_progress, released)
        with exporter(dsn, tmp_path) as url:
            last = scrape(url)
        assert one(last, "pg_idempotency_keys_total_estimate") == keys
        assert one(last, "pg_idempotency_keys_in_progress") == in_progress
        assert one(last, "pg_idempotency_keys_released") == released
        assert one(last, "pg_idempotency_keys_completed_estimate") == (
            keys - in_progress - released) > 0
        assert one(last, "pg_idempotency_maintain_last_run_age_seconds", 'outcome="ok"') < 60
        for column in ("created", "dropped", "rows_changed", "skipped_steps"):
            assert one(last, f"pg_idempotency_maintain_last_{column}") == (
                m[f"maintain_last_{column}"]), column
        assert m["maintain_last_created"] + m["maintain_last_dropped"] <= steps


# -- the alert rules ---------------------------------------------------------------------------

def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    need(PROMTOOL)
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=WAIT_BOUND)


@pytest.mark.prometheus
def test_alert_rules_pass_promtool_and_a_wrong_expectation_fails(tmp_path: Path) -> None:
    checked = promtool("check", "rules", "alerts.yml", cwd=MONITORING)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 9 rules found" in checked.stdout
    passed = promtool("test", "rules", "alerts_test.yml", cwd=MONITORING)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert "SUCCESS" in passed.stdout
    # The same tests with one expectation made wrong (the stuck-key alert expected a minute
    # before its 'for' has elapsed) must fail: promtool really compares.
    shutil.copy(MONITORING / "alerts.yml", tmp_path / "alerts.yml")
    text = (MONITORING / "alerts_test.yml").read_text()
    alert = "\n        alertname: IdempotencyKeysStuckInProgress"
    wrong = text.replace("eval_time: 11m" + alert, "eval_time: 10m" + alert, 1)
    assert wrong != text
    (tmp_path / "alerts_test.yml").write_text(wrong)
    failed = promtool("test", "rules", "alerts_test.yml", cwd=tmp_path)
    assert failed.returncode != 0
    assert "IdempotencyKeysStuckInProgress" in failed.stdout + failed.stderr


@pytest.mark.prometheus
def test_without_the_monitor_grant_the_series_vanish_and_an_alert_fires(
    server: PgServer, db: str, tmp_path: Path
) -> None:
    """Issue 34: an exporter connected as a role without the monitor grant stays up (pg_up 1)
    while every pg_idempotency_* series vanishes. What the real exporter exports then is fed to
    promtool with monitoring/alerts.yml: IdempotencyMetricsAbsent and
    IdempotencyExporterScrapeErrors fire, and do not for the same exporter with the grant."""
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute("SELECT count(*) FROM idempotency.maintain()")  # no maintain alert
    with login_roles(server, db, "request") as (role,):
        dsn = db.replace("postgres@", f"{role}@", 1) + "?sslmode=disable"
        with exporter(dsn, tmp_path) as url:
            blind = scrape_all(url)
        with psycopg.connect(db, autocommit=True) as conn:
            conn.execute("SELECT idempotency.grant_usage(%s::regrole, kind => 'monitor')",
                         (role,))
        with exporter(dsn, tmp_path) as url:
            seeing = scrape_all(url)
    assert blind["pg_up"] == 1
    assert not [name for name in blind if name.startswith("pg_idempotency")], blind
    assert blind["pg_exporter_last_scrape_error"] == 1
    assert seeing["pg_up"] == 1 and seeing["pg_exporter_last_scrape_error"] == 0
    assert seeing["pg_idempotency_keys_total_estimate"] == 0

    fired = {}
    for name, samples in (("blind", blind), ("seeing", seeing)):
        fired[name] = alerts_at(samples, tmp_path / name, "21m")
    assert fired["blind"] == {"IdempotencyMetricsAbsent", "IdempotencyExporterScrapeErrors"}
    assert fired["seeing"] == set()


def scrape_all(url: str) -> dict[str, float]:
    """Every unlabelled sample of a scrape, and our labelled ones by name (one each here)."""
    text = urllib.request.urlopen(url, timeout=WAIT_BOUND).read().decode()
    out: dict[str, float] = {}
    for name, _labels, value in re.findall(r"^(\w+)(\{[^}]*\})? (\S+)$", text, re.M):
        if name.startswith(("pg_up", "pg_exporter_", "pg_idempotency")):
            out[name] = float(value)
    return out


ALERTS = ("IdempotencyKeysStuckInProgress", "IdempotencyExpiredLeasesPilingUp",
          "IdempotencyMaintainNotRunning", "IdempotencyMaintainPartial",
          "IdempotencyPartitionsNotPremade", "IdempotencyMetricsAbsent",
          "IdempotencyExporterScrapeErrors", "IdempotencyDatabaseUnreachable",
          "IdempotencyExporterAbsent")


def alerts_at(samples: dict[str, float], workdir: Path, eval_time: str) -> set[str]:
    """The alerts of monitoring/alerts.yml firing at eval_time when every scrape gives these
    samples: one promtool test per alert expecting it silent; the ones whose test fails fire."""
    workdir.mkdir()
    shutil.copy(MONITORING / "alerts.yml", workdir / "alerts.yml")
    series = "".join(
        f"      - series: '{name}{{job=\"pg\",instance=\"db\"}}'\n"
        f"        values: '{value:g}x40'\n" for name, value in samples.items())
    firing = set()
    for alert in ALERTS:
        (workdir / "t.yml").write_text(
            "rule_files:\n  - alerts.yml\nevaluation_interval: 1m\ntests:\n"
            "  - interval: 1m\n    input_series:\n" + series
            + f"    alert_rule_test:\n      - eval_time: {eval_time}\n"
            f"        alertname: {alert}\n        exp_alerts: []\n")
        result = promtool("test", "rules", "t.yml", cwd=workdir)
        if result.returncode != 0:
            assert alert in result.stdout + result.stderr, result.stdout + result.stderr
            firing.add(alert)
    return firing
