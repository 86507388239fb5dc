"""A throwaway PostgreSQL server for the tests: ``initdb`` + ``pg_ctl`` in a temporary folder, on a
free port of 127.0.0.1, stopped at the end.  PostgreSQL refuses to run as root: as root the server
runs as the user ``nobody`` (``runuser``).  :func:`find_bin` is None when PostgreSQL is not installed
(the tests then skip, saying so)."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from typing import Optional

from serving import free_port


def find_bin() -> Optional[str]:
    """The folder holding ``initdb`` and ``pg_ctl`` (PATH first, then Debian's versioned folders)."""
    found = shutil.which("initdb")
    if found:
        return os.path.dirname(found)
    for folder in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if os.path.exists(os.path.join(folder, "initdb")):
            return folder
    return None


class PgServer:
    """``start()`` a server, ``url`` to connect (user ``ditattn``, trust auth on 127.0.0.1),
    ``stop()`` removes it all."""

    def __init__(self, bindir: str):
        self.bindir = bindir
        self.tmp = tempfile.mkdtemp(prefix="ditattn-pg-")
        self.data = os.path.join(self.tmp, "data")
        self.port = free_port()  # below the ephemeral range: no Ray process takes it meanwhile
        self.url = f"postgresql://ditattn@127.0.0.1:{self.port}/postgres"
        self._as = []
        if os.geteuid() == 0:
            os.chmod(self.tmp, 0o755)
            shutil.chown(self.tmp, "nobody")
            self._as = ["runuser", "-u", "nobody", "--"]

    def _pg(self, *args: str) -> None:
        subprocess.run(
            self._as + [os.path.join(self.bindir, args[0]), *args[1:]],
            check=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=self.tmp,
            timeout=120,
        )

    def start(self) -> "PgServer":
        self._pg("initdb", "-D", self.data, "-A", "trust", "-U", "ditattn", "--no-sync")
        opts = f"-p {self.port} -k {self.tmp} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=60"
        self._pg("pg_ctl", "-D", self.data, "-o", opts, "-l", os.path.join(self.tmp, "log"), "-w", "-t", "60", "start")
        return self

    def stop(self) -> None:
        try:
            self._pg("pg_ctl", "-D", self.data, "-m", "immediate", "-w", "stop")
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, FileNotFoundError):
            pass
        shutil.rmtree(self.tmp, ignore_errors=True)

    def fresh_db(self, name: str) -> str:
        """A new empty database ``name``; its URL."""
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}"')
            c.execute(f'CREATE DATABASE "{name}"')
        return self.url.rsplit("/", 1)[0] + "/" + name
