#!/usr/bin/env python3
"""pg_tle for the tests, and pg_idempotency as a Trusted Language Extension.

    tools/build_pg_tle.py [pg18] [pg15]   build pg_tle 1.5.2 from ../shared/pg_tle/ for the
                                          wheel's PostgreSQL 18 and Debian's PostgreSQL 15
                                          (both by default) and install it into each server's
                                          tree (make setup, target pg_tle)
    tools/build_pg_tle.py sql [--through VERSION] [--output FILE]
                                          write the pg_tle registration of build/extension/
                                          (made by tools/build.py) to build/pg_tle/
                                          pg_idempotency.sql, or FILE ("-": stdout)

pg_tle (https://github.com/aws/pg_tle) is how Amazon RDS and Aurora, and Supabase's
database.dev, let a role that is not a superuser install a SQL-only extension: a member of
``pgtle_admin`` registers the extension's scripts as data (``pgtle.install_extension``,
``pgtle.install_update_path``), after which ``CREATE EXTENSION`` and ``ALTER EXTENSION ...
UPDATE`` run them as the calling role, exactly as they would run files from the server's
extension directory. docs/managed.md is the user's page.

The registration (``sql``) takes build/extension/ as it is: the first version's full script
(``install_extension``), one ``install_update_path`` per upgrade script, the newest full script
(``install_extension_version_sql``, so that a new install runs one script, not the whole
chain) and ``set_default_version``. Each statement runs only when pg_tle does not have that
script yet (pg_tle keeps each one as a function ``pgtle."<name>--<version>.sql"()``,
its docs/30_architecture.md), and the default version only ever moves forward: the newest file,
run on a database that a file of an older release registered, adds the new upgrade scripts and
nothing else. pg_tle refuses a script that contains its own delimiters ``$_pgtle_o_$`` or
``$_pgtle_i_$`` (it wraps each script in them), and a file-based extension of the same name in
the server's extension directory; the first is checked here, the second is the operator's.
A script's text changes nowhere: pg_tle, like CREATE EXTENSION, drops the ``\\echo`` line and
would substitute ``@extschema@`` (the scripts use neither that nor ``@extowner@``).

The build (the default) follows tools/build_citus.py: one runtime tarball per flavour, cached
in ``build/pg_tle/<key>.tar.gz`` and keyed on the pg_tle release, the exact server version and
the compiler; a second run builds nothing and installs only the files that differ.
``CC=clang-14`` for both servers (gcc 12 rejects a flag in the wheel's CFLAGS), ``with_llvm=no``
(no JIT bitcode), linked ``-Bsymbolic`` (MAKE_ARGS says why: without it pg_tle crashes
PostgreSQL 15). The server needs ``shared_preload_libraries = 'pg_tle'`` (the tests start their
own: harness/pg_tle_server.py). Missing sources are reported loudly and the tests that use
pg_tle fail saying so; they are never skipped.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from build_citus import CC, apt_install, bindir, deb_version, install, pg_config, run

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "build" / "pg_tle"
EXTENSION_DIR = ROOT / "build" / "extension"
EXTENSION = "pg_idempotency"
PG_TLE_VERSION = "1.5.2"
FLAVOURS = ("pg18", "pg15")
# -Bsymbolic: pg_tle parses a registered control string with its own copy of PostgreSQL's
# configuration-file lexer, whose functions keep PostgreSQL's names (GUC_yylex, ...). PostgreSQL
# 15 exports the same names from the server binary and builds extensions without
# -fvisibility=hidden, so the library's calls bound to the server's lexer instead: the first
# install_extension() crashed the backend, and CREATE EXTENSION of a registered extension found
# no default_version. Binding the library's own symbols to itself fixes both; PostgreSQL 16+
# hides them already, and the flag changes nothing there.
MAKE_ARGS = ["with_llvm=no", "LDFLAGS_SL=-Wl,-Bsymbolic"]
# What make needs besides the server headers (guc-file.l wants flex).
BUILD_DEBS = ["clang-14", "make", "flex"]
# Bump when the recipe below changes in a way the key would not see.
RECIPE = "2"
# pg_tle wraps every script in these and refuses one that contains either (tleextension.h).
PG_TLE_DELIMITERS = ("$_pgtle_o_$", "$_pgtle_i_$")
# Our own quote around each script in the registration file.
QUOTE = "$pg_idempotency_tle$"
SCRIPT_RE = re.compile(rf"^{EXTENSION}--([0-9.]+)(?:--([0-9.]+))?\.sql$")


# -- the registration ------------------------------------------------------------------------


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _script(path: Path) -> str:
    text = path.read_text()
    for delimiter in (*PG_TLE_DELIMITERS, QUOTE):
        if delimiter in text:
            raise SystemExit(f"{path}: contains {delimiter}, which pg_tle refuses (or which "
                             "quotes the scripts in the registration): pg_tle cannot take it")
    return f"{QUOTE}{text}{QUOTE}"


def _missing(function: str) -> str:
    """The condition that pg_tle has no script function of that name yet."""
    return f"WHERE to_regprocedure({_literal(f'pgtle.{chr(34)}{function}{chr(34)}()')}) IS NULL"


def registration(extension_dir: Path = EXTENSION_DIR, through: str | None = None) -> str:
    """The SQL that registers ``extension_dir``'s scripts with pg_tle (versions up to
    ``through``, by default all of them); run by a member of ``pgtle_admin``."""
    control = (extension_dir / f"{EXTENSION}.control").read_text()
    newest = re.search(r"^default_version = '([^']+)'", control, re.M)
    comment = re.search(r"^comment = '((?:[^']|'')*)'", control, re.M)
    if newest is None or comment is None:
        raise SystemExit(f"{extension_dir}/{EXTENSION}.control: no default_version or comment")
    full: dict[str, Path] = {}
    updates: dict[tuple[str, str], Path] = {}
    for path in extension_dir.glob(f"{EXTENSION}--*.sql"):
        found = SCRIPT_RE.match(path.name)
        if found is None:
            raise SystemExit(f"{path}: not a script name this tool knows")
        source, target = found.groups()
        if target is None:
            full[source] = path
        else:
            updates[(source, target)] = path
    top = through or newest.group(1)
    if top not in full and top not in {t for _, t in updates}:
        raise SystemExit(f"no version {top} in {extension_dir} (versions: "
                         f"{', '.join(sorted({*full, *(t for _, t in updates)}, key=_key))})")
    first = min(full, key=_key)
    lines = [
        f"-- {EXTENSION} {top} as a Trusted Language Extension (pg_tle), made by "
        "tools/build_pg_tle.py",
        "-- from the CREATE EXTENSION scripts. Run it as a member of pgtle_admin in the database,",
        "-- after CREATE EXTENSION pg_tle there; each statement registers a script pg_tle does",
        "-- not have yet, so the file of a newer release adds only its new upgrade scripts.",
        f"-- Then CREATE EXTENSION {EXTENSION}, or ALTER EXTENSION {EXTENSION} UPDATE "
        "(docs/managed.md).",
        "",
        f"SELECT pgtle.install_extension({_literal(EXTENSION)}, {_literal(first)}, "
        f"{_literal(comment.group(1).replace(chr(39) * 2, chr(39)))},",
        f"{_script(full[first])})",
        f"{_missing(f'{EXTENSION}.control')};",
    ]
    for source, target in sorted(updates, key=lambda pair: _key(pair[1])):
        if _key(target) > _key(top):
            continue
        lines += ["",
                  f"SELECT pgtle.install_update_path({_literal(EXTENSION)}, {_literal(source)}, "
                  f"{_literal(target)},",
                  f"{_script(updates[(source, target)])})",
                  f"{_missing(f'{EXTENSION}--{source}--{target}.sql')};"]
    if top != first and top in full:
        lines += ["",
                  "-- The newest version in one script: CREATE EXTENSION runs it rather than "
                  "the chain.",
                  f"SELECT pgtle.install_extension_version_sql({_literal(EXTENSION)}, "
                  f"{_literal(top)},",
                  f"{_script(full[top])})",
                  f"{_missing(f'{EXTENSION}--{top}.sql')};"]
    lines += ["",
              "-- The default version moves forward only (an older file run later leaves it).",
              f"SELECT pgtle.set_default_version({_literal(EXTENSION)}, {_literal(top)})",
              f"WHERE (SELECT string_to_array(default_version, '.')::int[] "
              f"FROM pgtle.available_extensions() WHERE name = {_literal(EXTENSION)})",
              f"      < string_to_array({_literal(top)}, '.')::int[];",
              ""]
    return "\n".join(lines)


# -- the build -------------------------------------------------------------------------------


def sources() -> Path:
    """``$PG_TLE_SOURCES``, else ``shared/pg_tle`` beside the clone; a git worktree also looks
    beside its main clone (as tools/build_citus.py does for Citus)."""
    if os.environ.get("PG_TLE_SOURCES"):
        return Path(os.environ["PG_TLE_SOURCES"])
    here = ROOT.parent / "shared" / "pg_tle"
    proc = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--path-format=absolute",
                           "--git-common-dir"], capture_output=True, text=True)
    if here.is_dir() or proc.returncode != 0:
        return here
    main = Path(proc.stdout.strip()).parent.parent / "shared" / "pg_tle"
    return main if main.is_dir() else here


def ensure_build_deps(flavour: str) -> None:
    missing = [p for p in BUILD_DEBS if deb_version(p) is None]
    if flavour == "pg15":
        # The headers pinned to the installed server (tools/build_citus.py says why).
        server = deb_version("postgresql-15")
        if server is None:
            raise SystemExit("postgresql-15 is not installed (make deb-deps)")
        if deb_version("postgresql-server-dev-15") != server:
            missing.append(f"postgresql-server-dev-15={server}")
    if missing:
        apt_install(missing)


def cache_key(flavour: str, tarball: Path) -> str:
    server = run([str(bindir(flavour) / "postgres"), "--version"]).strip()
    compiler = run([CC, "--version"]).splitlines()[0].strip()
    headers = pg_config(flavour, "--version")
    if headers.split()[-1] not in server:
        raise SystemExit(f"{flavour}: headers are {headers} but the server is {server}")
    digest = hashlib.sha256()
    for part in (server, compiler, RECIPE, " ".join(MAKE_ARGS)):
        digest.update(part.encode() + b"\0")
    digest.update(tarball.read_bytes())
    server_version = re.sub(r"[^0-9A-Za-z.+-]+", "_", server.split("(PostgreSQL)")[-1].strip())
    cc = re.sub(r"[^0-9A-Za-z.+-]+", "_", compiler)
    return f"pg_tle-{PG_TLE_VERSION}_pg-{server_version}_{cc}_{digest.hexdigest()[:10]}"


def build(flavour: str, tarball: Path, out: Path) -> None:
    print(f"building pg_tle {PG_TLE_VERSION} for {flavour} (about 15 s on 2 cores; log: "
          "build/pg_tle/*.log)", flush=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    log = Path(str(out).removesuffix(".tar.gz") + ".log")
    with tempfile.TemporaryDirectory(dir=CACHE, prefix="work-") as work, \
            open(log, "w") as logf:
        work_dir = Path(work)
        with tarfile.open(tarball) as tf:
            # filter= only from Python 3.11.4 (Debian 12 has 3.11.2); a release tarball
            tf.extractall(work_dir, **({"filter": "data"} if hasattr(tarfile, "data_filter")
                                       else {}))
        (src,) = [p for p in work_dir.iterdir() if p.is_dir()]
        # On make's command line: pgxs's Makefile.global sets CC itself, over the environment.
        args = [f"PG_CONFIG={bindir(flavour) / 'pg_config'}", f"CC={CC}", *MAKE_ARGS]
        stage = work_dir / "stage"
        for step in (["make", f"-j{os.cpu_count() or 2}", *args],
                     ["make", "install", *args, f"DESTDIR={stage}"]):
            logf.write(f"$ {' '.join(step)}\n")
            logf.flush()
            proc = subprocess.run(step, cwd=src, stdout=logf, stderr=subprocess.STDOUT)
            if proc.returncode != 0:
                logf.close()
                sys.stderr.write(log.read_text()[-6000:])
                raise SystemExit(f"pg_tle build failed for {flavour}: {' '.join(step)} "
                                 f"(log: {log})")
        pkglib = stage / pg_config(flavour, "--pkglibdir").lstrip("/")
        extdir = stage / pg_config(flavour, "--sharedir").lstrip("/") / "extension"
        partial = Path(str(out) + ".partial")
        with tarfile.open(partial, "w:gz") as tf:
            tf.add(pkglib, "lib")
            tf.add(extdir, "extension")
        partial.rename(out)


def build_all(flavours: list[str]) -> int:
    tarball = sources() / f"pg_tle-{PG_TLE_VERSION}.tar.gz"
    if not tarball.is_file():
        bar = "!" * 78
        sys.stderr.write(f"{bar}\nPG_TLE SOURCES MISSING: {tarball}\nThe pg_tle tests will "
                         f"FAIL. Put the release tarball in {sources()} (CI lays shared/ "
                         f"beside the clone), or set PG_TLE_SOURCES.\n{bar}\n")
        return 0
    for flavour in flavours:
        ensure_build_deps(flavour)
        out = CACHE / f"{cache_key(flavour, tarball)}.tar.gz"
        if not out.is_file():
            build(flavour, tarball, out)
        n = install(flavour, out)
        print(f"pg_tle {PG_TLE_VERSION} for {flavour}: {out.name}"
              + (f" ({n} files installed)" if n else " (installed)"), flush=True)
    return 0


def main() -> int:
    if sys.argv[1:2] == ["sql"]:
        parser = argparse.ArgumentParser(prog="build_pg_tle.py sql",
                                         description="write the pg_tle registration")
        parser.add_argument("--through", metavar="VERSION",
                            help="register versions up to this one (default: the newest)")
        parser.add_argument("--output", "-o", default=str(CACHE / f"{EXTENSION}.sql"),
                            help="where to write it ('-': stdout)")
        args = parser.parse_args(sys.argv[2:])
        if not (EXTENSION_DIR / f"{EXTENSION}.control").is_file():
            raise SystemExit(f"{EXTENSION_DIR} has no {EXTENSION}.control: run tools/build.py")
        text = registration(EXTENSION_DIR, args.through)
        if args.output == "-":
            sys.stdout.write(text)
        else:
            Path(args.output).parent.mkdir(parents=True, exist_ok=True)
            Path(args.output).write_text(text)
            print(f"wrote {args.output}")
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("flavours", nargs="*", choices=[*FLAVOURS, []])
    args = parser.parse_args()
    return build_all(args.flavours or list(FLAVOURS))


if __name__ == "__main__":
    sys.exit(main())
