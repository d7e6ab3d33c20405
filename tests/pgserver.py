"""A throwaway PostgreSQL server for the tests and benchmarks: the Debian server binaries (initdb, postgres), run
as an unprivileged user, listening on a unix socket only (no TCP port), in a new temporary directory that is
deleted when the server stops.

    with PostgresServer() as pg:
        url = pg.database("t1")        # postgresql://nanorft@/t1?host=/tmp/nanorft-pg-xxxx: a new, empty database
        ...
        pg.halt(); pg.resume()         # a server restart (the data kept): every connection is lost

Over TCP too (tests/test_hosts.py): `PostgresServer(listen="198.18.0.1", wrap=hosts_command)` listens on that address
(port 5432) as well, run through `wrap(argv, user)` (e.g. inside a network namespace: tests/netns.py), where every TCP
login needs a password (scram-sha-256); `pg.login("rft", password, "rft")` makes such a role and its database and
returns the URL, without the password (the processes get it from PGPASSWORD). The admin stays on the socket.

As root (CI containers), the server runs as the `postgres` user (created by Debian's package), else `nobody`:
postgres refuses to run as root. `fast=True` turns fsync off (tests); benchmarks keep the defaults.
"""

from __future__ import annotations

import ctypes
import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable

ADMIN = "nanorft"  # the superuser initdb creates; trust authentication on the socket


def find(program: str) -> str | None:
    """A PostgreSQL server binary: on PATH, else Debian's /usr/lib/postgresql/<version>/bin (newest version)."""
    found = shutil.which(program)
    if found:
        return found
    versions = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{program}"), key=lambda p: int(p.split("/")[4]))
    return versions[-1] if versions else None


def missing() -> str:
    """Why no server can start here ("" if one can)."""
    gone = [p for p in ("initdb", "postgres") if find(p) is None]
    if gone:
        return f"PostgreSQL server binaries not found ({', '.join(gone)}): apt-get install postgresql"
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed: pip install -e '.[postgres]'"
    return ""


def _stop_with_parent() -> None:
    """In the server's process before exec: a fast shutdown (SIGINT) when the process that started it dies, even by
    SIGKILL, so that a killed test run leaves no server behind. NOTE: Linux's PR_SET_PDEATHSIG; it must be set after
    the change of user (which clears it), and subprocess runs preexec_fn after that change."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGINT)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the server stops with the fixture only
        pass


class PostgresServer:
    def __init__(self, fast: bool = True, listen: str = "", wrap: Callable | None = None) -> None:
        self.fast, self.proc, self.dir, self.count = fast, None, "", 0
        self.listen, self.wrap = listen, wrap
        self.user = None
        if os.geteuid() == 0:
            names = {p.pw_name for p in pwd.getpwall()}
            self.user = "postgres" if "postgres" in names else "nobody"

    def start(self) -> PostgresServer:
        why = missing()
        if why:
            raise RuntimeError(why)
        # NOTE: under /tmp itself, not pytest's tmp_path: that sits in a 0700 folder of root's that the server's
        # user cannot enter.
        self.dir = tempfile.mkdtemp(prefix="nanorft-pg-")
        if self.user:
            shutil.chown(self.dir, self.user)
        self._run(
            [
                find("initdb"),
                "-D",
                os.path.join(self.dir, "data"),
                "-U",
                ADMIN,
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
            ]
        )
        if self.listen:  # the socket as before; over TCP a password, scram-sha-256 (PostgreSQL 15's default hash)
            with open(os.path.join(self.dir, "data", "pg_hba.conf"), "w") as f:
                f.write("local all all trust\nhost all all 0.0.0.0/0 scram-sha-256\n")
        self._launch()
        return self

    def _launch(self) -> None:
        """The server process on the data directory; returns once it accepts connections. NOTE: call it from a thread
        that outlives the server: PR_SET_PDEATHSIG fires when the *thread* that started it ends."""
        settings = ["-c", f"listen_addresses={self.listen}", "-c", f"unix_socket_directories={self.dir}"]
        settings += ["-c", "max_connections=200"]
        if self.fast:
            settings += ["-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"]
        cmd = [find("postgres"), "-D", os.path.join(self.dir, "data"), *settings]
        with open(os.path.join(self.dir, "server.log"), "a") as log:
            self.proc = subprocess.Popen(
                self.wrap(cmd, self.user) if self.wrap else cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                user=None if self.wrap else self.user,  # NOTE: wrap changes user itself (after entering a namespace)
                start_new_session=True,
                preexec_fn=_stop_with_parent,
            )
        self._wait_ready()

    def halt(self) -> None:
        """Stop the server process (a fast shutdown: every session is ended), keeping its data; `resume` starts it
        again (tests of lost connections)."""
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=30)

    def resume(self) -> None:
        self._launch()

    def _run(self, cmd: list[str]) -> None:
        out = subprocess.run(cmd, user=self.user, capture_output=True, text=True, cwd=self.dir)
        if out.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed: {out.stdout[-2000:]}{out.stderr[-2000:]}")

    def _wait_ready(self, timeout: float = 60.0) -> None:
        import psycopg

        deadline = time.monotonic() + timeout
        while True:
            try:
                psycopg.connect(self.url("postgres"), connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    text = open(os.path.join(self.dir, "server.log")).read()[-2000:]
                    self.stop()
                    raise RuntimeError(f"the PostgreSQL server did not start: {text}") from None
                time.sleep(0.1)

    def url(self, database: str) -> str:
        return f"postgresql://{ADMIN}@/{database}?host={self.dir}"

    def database(self, name: str = "") -> str:
        """A new, empty database on this server; its URL."""
        import psycopg

        self.count += 1
        name = name or f"t{self.count}"
        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def login(self, user: str, password: str, database: str) -> str:
        """A role `user` that logs in with `password` (stored as a scram-sha-256 hash), owning a new database
        `database`: the URL to it over TCP, without the password."""
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            conn.execute(
                sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(sql.Identifier(user), sql.Literal(password))
            )
            conn.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(database), sql.Identifier(user)))
        return f"postgresql://{user}@{self.listen}:5432/{database}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # fast shutdown: ends the sessions, no checkpoint wait
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = ""

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
