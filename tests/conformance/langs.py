"""The Java, Go and Ruby runners (java/, go/, ruby/): how to build and start each one.

Compiled artefacts are cached under build/conformance/, in a directory named after a hash of
the sources, so a second ``make test`` with unchanged sources compiles nothing. Every runner
is started as ``COMMAND FUNCTIONS.json DSN SCENARIO.json...`` and prints what node/run.mjs
prints: one JSON line a scenario, exit 0 / 1 (a scenario failed) / 2 (usage, connection).
read_results() turns those lines into failures by scenario, adding one where a runner ran
fewer steps or made fewer checks than the scenario has.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from conformance import API_FILE, HERE, NODE_DIR, count_failures, load_scenario, node_command
from pgharness import WAIT_BOUND

ROOT = HERE.parent.parent
BUILD = ROOT / "build" / "conformance"
JDBC_JAR = Path("/usr/share/java/postgresql.jar")
GOPATH_DEBIAN = Path("/usr/share/gocode")
LANGS = ("java", "go", "ruby")


def need(tool: str, package: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise RuntimeError(f"{tool} is not on PATH: make setup installs {package}")
    return path


def _digest(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _compile(argv: list[str], env: dict[str, str] | None = None) -> None:
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=WAIT_BOUND)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{proc.stdout}{proc.stderr}")


def _cached(name: str, sources: list[Path], build: Callable[[Path], None]) -> Path:
    """build(out_dir) once for these sources; later calls reuse build/conformance/NAME-HASH."""
    out = BUILD / f"{name}-{_digest(sources)}"
    if not (out / ".built").exists():
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        build(tmp)
        (tmp / ".built").touch()
        if not (out / ".built").exists():
            shutil.rmtree(out, ignore_errors=True)  # a half-built leftover
        try:
            tmp.rename(out)
        except OSError:  # another process (a pytest-xdist worker) built it meanwhile
            if not (out / ".built").exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
        for old in BUILD.glob(f"{name}-*"):  # builds of older sources
            if old != out and not old.name.startswith(out.name):
                shutil.rmtree(old, ignore_errors=True)
    return out


def go_env() -> dict[str, str]:
    """Offline GOPATH mode: lib/pq from Debian's tree, the build cache under build/."""
    return {**os.environ, "GO111MODULE": "off",
            "GOPATH": str(BUILD / "gopath") + os.pathsep + str(GOPATH_DEBIAN),
            "GOCACHE": str(BUILD / "gocache")}


def go_binary(name: str, sources: list[Path]) -> Path:
    """``go build`` of these files (one package main), cached."""
    go = need("go", "golang-go")

    def build(out: Path) -> None:
        _compile([go, "build", "-o", str(out / name), *map(str, sources)], env=go_env())
    return _cached(f"go-{name}", sources, build) / name


def java_classes(name: str, sources: list[Path]) -> Path:
    """``javac`` of these files against Debian's pgJDBC, cached; the class directory."""
    javac = need("javac", "openjdk-17-jdk-headless")
    if not JDBC_JAR.exists():
        raise RuntimeError(f"{JDBC_JAR} is missing: make setup installs libpostgresql-jdbc-java")

    def build(out: Path) -> None:
        _compile([javac, "-Xlint:all", "-Werror", "-encoding", "UTF-8", "-cp",
                  str(JDBC_JAR), "-d", str(out), *map(str, sources)])
    return _cached(f"java-{name}", sources, build)


def java_command(main_class: str, sources: list[Path]) -> list[str]:
    classes = java_classes(main_class, sources)
    return [need("java", "openjdk-17-jdk-headless"), "-cp",
            f"{classes}{os.pathsep}{JDBC_JAR}", main_class]


def runner_command(lang: str) -> list[str]:
    """The command line of a runner, up to (not including) FUNCTIONS.json DSN FILES."""
    if lang == "go":
        return [str(go_binary("run", [HERE / "go" / "run.go"]))]
    if lang == "java":
        return java_command("Run", [HERE / "java" / "Run.java"])
    if lang == "ruby":
        return [need("ruby", "ruby"), str(HERE / "ruby" / "run.rb")]
    raise ValueError(lang)


def read_results(stdout: str, files: list[Path]) -> dict[str, list[str]]:
    """A runner's output lines as failures by scenario name. Each line's steps and checks are
    compared with the scenario's own (conformance.count_failures): a runner that skipped a
    step or a check fails even when all it did check passed."""
    scenarios = {s["name"]: s for s in map(load_scenario, files)}
    results = {}
    for line in stdout.splitlines():
        record = json.loads(line)
        name = record["name"]
        results[name] = record["failures"]
        if name in scenarios:
            results[name] = results[name] + count_failures(
                scenarios[name], record.get("steps"), record.get("checks"))
    return results


def run_runner(lang: str, dsn: str, files: list[Path],
               timeout: float = WAIT_BOUND) -> tuple[int, dict[str, list[str]], str]:
    """Run one runner over ``files``: (exit code, failures by scenario name, stderr)."""
    proc = subprocess.run([*runner_command(lang), str(API_FILE), dsn, *map(str, files)],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    return proc.returncode, read_results(proc.stdout, files), proc.stderr


def run_node(dsn: str, files: list[Path]) -> tuple[int, dict[str, list[str]], str]:
    """The Node.js runner over ``files`` in one process: exit code, failures by scenario, stderr."""
    proc = subprocess.run([*node_command(), dsn, *map(str, files)], capture_output=True,
                          text=True, timeout=WAIT_BOUND, cwd=NODE_DIR)
    return proc.returncode, read_results(proc.stdout, files), proc.stderr
