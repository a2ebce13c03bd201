"""A server as a managed service offers it: pg_tle preloaded, and no pg_idempotency files.

pg_tle refuses to register an extension whose control file is in the server's extension
directory, and CREATE EXTENSION would take the file over the registration. The test servers'
directories hold this checkout's build/extension/ (tests/helpers/servers.py copies it there, and
PostgreSQL 15's is the system one, shared with every checkout), so a pg_tle server runs from a
tree of its own: a copy of ``postgres`` (PostgreSQL finds its share and lib directories from
where its executable really is, symlinks resolved), beside links to everything else of the
install except the pg_idempotency files (a few milliseconds and 11 MB, once per process).

pg_tle itself is built into both installs by ``make setup`` (tools/build_pg_tle.py); without it
:func:`pg_tle_server` fails, saying so.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

from pgharness import HarnessError, PgServer, _clean_env, _process_dir, flavour_bindir

HIDDEN = "pg_idempotency"
# One tree per install and process: the harness runs initdb once per bin directory.
_TREES: dict[tuple[Path, str], Path] = {}
# The shared servers also preload pg_cron where Debian has it (PostgreSQL 15), living in a
# database of this name (made by the test that uses it), as a managed service offers both.
CRON_DATABASE = "payments_cron"
SHARED_CONF: dict[str, dict[str, object]] = {
    "pg15": {"shared_preload_libraries": "pg_tle,pg_cron", "cron.database_name": CRON_DATABASE}}
_SHARED: dict[str, PgServer] = {}
# Copied rather than linked: they locate the install from their own path.
COPIED = ("postgres", "pg_config")


def _pg_config(bindir: Path, option: str) -> Path:
    return Path(subprocess.run([str(bindir / "pg_config"), option], check=True,
                               capture_output=True, text=True, env=_clean_env()).stdout.strip())


def tree_without(bindir: Path, hidden: str = HIDDEN) -> Path:
    """The bin directory of a private tree of the install at ``bindir`` whose extension
    directory lacks the files of extension ``hidden``; made once per process."""
    if (bindir, hidden) in _TREES and _TREES[(bindir, hidden)].is_dir():
        return _TREES[(bindir, hidden)]
    dirs = {name: _pg_config(bindir, f"--{name}") for name in ("bindir", "pkglibdir",
                                                                 "sharedir")}
    prefix = Path(os.path.commonpath(list(dirs.values())))
    root = Path(tempfile.mkdtemp(prefix="tree-", dir=_process_dir()))
    place = {name: root / path.relative_to(prefix) for name, path in dirs.items()}
    place["bindir"].mkdir(parents=True)
    for entry in dirs["bindir"].iterdir():
        if entry.name in COPIED:
            shutil.copy2(entry, place["bindir"] / entry.name)
        else:
            (place["bindir"] / entry.name).symlink_to(entry)
    place["pkglibdir"].parent.mkdir(parents=True, exist_ok=True)
    place["pkglibdir"].symlink_to(dirs["pkglibdir"], target_is_directory=True)
    place["sharedir"].mkdir(parents=True)
    for entry in dirs["sharedir"].iterdir():
        if entry.name != "extension":
            (place["sharedir"] / entry.name).symlink_to(entry)
    (place["sharedir"] / "extension").mkdir()
    for entry in (dirs["sharedir"] / "extension").iterdir():
        if entry.name != f"{hidden}.control" and not entry.name.startswith(f"{hidden}--"):
            (place["sharedir"] / "extension" / entry.name).symlink_to(entry)
    _TREES[(bindir, hidden)] = place["bindir"]
    return place["bindir"]


def pg_tle_server(flavour: str, name: str = "pg_tle",
                  extra_conf: Mapping[str, object] | None = None) -> PgServer:
    """A started server of ``flavour`` (pg15, pg18) with ``shared_preload_libraries =
    'pg_tle'`` (``extra_conf`` adds settings; a list of its own there must name pg_tle too),
    from a tree without pg_idempotency's files; stop it when done."""
    bindir = flavour_bindir(flavour)
    extension = _pg_config(bindir, "--sharedir") / "extension" / "pg_tle.control"
    library = _pg_config(bindir, "--pkglibdir") / "pg_tle.so"
    if not (extension.is_file() and library.is_file()):
        raise HarnessError(
            f"pg_tle is not installed for {flavour} ({extension} or {library} is missing): "
            "run make setup as root (tools/build_pg_tle.py builds it from ../shared/pg_tle/; "
            "its output says why it did not)")
    server = PgServer(tree_without(bindir), name=f"{name}-{flavour}",
                      extra_conf={"shared_preload_libraries": "pg_tle", **(extra_conf or {})})
    return server.start()


def shared_pg_tle_server(flavour: str) -> PgServer:
    """One started :func:`pg_tle_server` per flavour and process, with SHARED_CONF, for tests
    that each work in databases and roles of their own (so a module more costs no initdb and
    no start); it stops when the process exits."""
    server = _SHARED.get(flavour)
    if server is None or server.tmpdir is None:
        server = pg_tle_server(flavour, name="pg_tle-shared", extra_conf=SHARED_CONF.get(flavour))
        _SHARED[flavour] = server
    return server
