"""dbconn.py: the experience DB's two back-ends below buffer.py's ExperienceDB: a SQLite file (WAL, BEGIN
IMMEDIATE) or a PostgreSQL database through psycopg 3 (`PostgresLink`, which outlives a server restart where that is
safe); the URL forms; the errors that name what is wrong with a DB.

    conn = open_sqlite("runs/x/buffer.db", busy_timeout=60)      # with transaction(conn) as cur: ...
    link = PostgresLink("postgresql://user@host/db", 60)         # link.run(lambda cur: ..., atomic=True)

A PostgreSQL connection can be lost under a running process: a server restart, a failover, a network cut, an
administrator's pg_terminate_backend. `PostgresLink.run` opens it again (waiting up to the busy timeout for the server
to come back: 60 s, or $NANORFT_DB_TIMEOUT: `db_timeout`) and runs the work once more where that cannot do it twice:
a read, or a transaction the server rolled back because the connection went before COMMIT. A connection lost during
COMMIT (committed or not is unknown) or lost again raises DBUnavailable, a named error (no traceback): the process
stops, and a restart continues from what the DB holds. A network path that goes dead (a cut link, a lost host) is
noticed after DEAD_LINK_S or the busy timeout, the shorter (TCP keepalives and tcp_user_timeout: `link_timeouts`), not
after the kernel's ~15 minutes of retransmissions. A lock waited for past the busy timeout (SQLite's "database is
locked", PostgreSQL's `lock_timeout`) or a statement the server cancelled (its `statement_timeout`) raise DBBusy (a
DBUnavailable), which says what to look for.
A full, read-only or failing disk, or a damaged file (SQLite: "database or disk is full", "disk I/O error", "database
disk image is malformed"; PostgreSQL: its disk-full, I/O and corruption errors) raise DBFault, which says what to do;
the failed transaction is rolled back. A whole SQLite file that cannot be written (a read-only file system, file or
folder) is named so as it is opened (`read_only`), not called damaged.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

log = logging.getLogger("nanorft.buffer")
T = TypeVar("T")


class DBMismatch(RuntimeError):
    """This experience DB cannot be shared with this process: another schema version or another model, another
    program's data, or a database that cannot be reached."""


class DBUnavailable(DBMismatch):
    """The PostgreSQL server stopped serving this process: the connection was lost (a server restart, a network cut,
    pg_terminate_backend) and could not be opened again within the busy timeout, or was lost while a transaction
    committed (committed or not: unknown), or a lock was waited for past the busy timeout. Restart the process once the
    server is back: what it committed is in the DB, and it continues from there."""


class DBBusy(DBUnavailable):
    """A lock on the experience DB was waited for past the busy timeout (SQLite: "database is locked"; PostgreSQL:
    lock_timeout), or the server cancelled a statement (statement_timeout): another process holds the DB busy.
    Nothing of the waiting transaction was written."""


class DBFault(DBMismatch):
    """The experience DB's storage failed under a running process: its disk is full, read-only or failing (an I/O
    error), or its file is damaged (corrupt pages); or, as it is opened, a whole file cannot be written (read-only).
    The transaction in progress was rolled back: what was committed before is in the DB."""


_FULL = (
    "free space on that disk, or point buffer.trainer_input.experience_buffer.path at a new file on another "
    "disk, then run again: the run continues from what the DB holds, the trainer from its last checkpoint"
)
_DAMAGED = (
    "restore it from a backup, or point buffer.trainer_input.experience_buffer.path at a new file (the run "
    "then starts from no experiences; the trainer still resumes from its last checkpoint)"
)
# SQLite's primary result code (sqlite3.Error.sqlite_errorname, Python >= 3.11, extended codes cut at their second _;
# its message text before) -> what the DB's disk or file did, what to do
SQLITE_FAULTS = {
    "SQLITE_FULL": ("the disk holding it is full", _FULL),
    "SQLITE_IOERR": ("its disk reported an I/O error", "check the disk (dmesg), then run again"),
    "SQLITE_READONLY": ("it cannot be written (read-only)", "make the file and its folder writable, then run again"),
    "SQLITE_CORRUPT": ("its file is damaged", _DAMAGED),
    "SQLITE_NOTADB": ("its file is damaged (not a database)", _DAMAGED),
}
_SQLITE_TEXTS = {
    "database or disk is full": "SQLITE_FULL",
    "disk i/o error": "SQLITE_IOERR",
    "readonly database": "SQLITE_READONLY",
    "malformed": "SQLITE_CORRUPT",
    "file is not a database": "SQLITE_NOTADB",
}


def sqlite_fault(e: sqlite3.Error, path: str) -> DBFault | None:
    """The DBFault for a SQLite error of a full, read-only or failing disk or a damaged file; None for others (a
    lock waited for past the busy timeout, an SQL error: the caller's to raise)."""
    code = "_".join(getattr(e, "sqlite_errorname", "").split("_")[:2])
    if code not in SQLITE_FAULTS:
        code = next((c for text, c in _SQLITE_TEXTS.items() if text in str(e).lower()), "")
    if code not in SQLITE_FAULTS:
        return None
    what, todo = SQLITE_FAULTS[code]
    kept = "" if todo is _DAMAGED else "; what was committed before is kept, the failed transaction was rolled back"
    return DBFault(f"experience DB {path}: {what} ({e}){kept}. {todo[0].upper()}{todo[1:]}.")


def sqlite_busy(e: sqlite3.Error, path: str, busy_timeout: float | None, what: str) -> DBBusy | None:
    """The DBBusy for SQLite's "database is locked" (SQLITE_BUSY: `what` waited the busy timeout out for another
    connection's lock); None for any other error."""
    if getattr(e, "sqlite_errorname", "").split("_")[:2] != ["SQLITE", "BUSY"] and "database is locked" not in str(e):
        return None
    waited = f"{busy_timeout:g} s" if busy_timeout is not None else "the busy timeout"
    return DBBusy(
        f"experience DB {path}: {what} waited {waited} for a lock another process holds ({e}); nothing of it was "
        f"written. Another process holds the DB busy: one stopped (SIGSTOP) or stuck in a transaction, a sqlite3 "
        f"shell with an open transaction, a backup copying it (`fuser {path}` lists them); end it, then run again: "
        "the run continues from what the DB holds"
    )


@contextmanager
def sqlite_faults(path: str, busy_timeout: float | None = None, what: str = "a statement") -> Iterator[None]:
    """Raise a SQLite error of a full or failing disk or a damaged file as the DBFault naming it (sqlite_fault),
    and "database is locked" (`what` waited past `busy_timeout` s) as DBBusy (sqlite_busy)."""
    try:
        yield
    except sqlite3.Error as e:
        fault = sqlite_fault(e, path) or sqlite_busy(e, path, busy_timeout, what)
        if fault is None:
            raise
        raise fault from None


def is_postgres(url: str) -> bool:
    return url.startswith(("postgresql://", "postgres://"))


_HOST = r"(?=[^@/?#\s]*(?:[/?#\s]|$))"  # what follows the password's @: a host, then the path, query or the end
# NOTE: the password runs to the last @ before the query (`u:pa@ss@host`, `u:pa/ss@host`), else to the last @ of the
# URL (`u:pa?ss@host`): a URL whose query holds an @ may then show less than its host, never part of its password
_URL_PASSWORD = re.compile(rf"(\b[A-Za-z][\w+.-]*://[^:/?#@\s]*):(?:[^?#\s]*@{_HOST}|\S*@{_HOST})")
_QUERY_SECRET = re.compile(
    r"([?&;](?:password|passwd|pwd|pass|secret|token|access_token|api_?key|sig|signature|"
    r"credentials?)=)[^&#\s]*",
    re.IGNORECASE,
)


def shown(url: str) -> str:
    """The URL (or a text holding URLs) as messages show it: a password in it (scheme://user:password@host, however
    spelt: with @, / or %-escapes in it, no user) and a query's password / token / key (?password=...) replaced by
    ***; the host stays visible."""
    return _QUERY_SECRET.sub(r"\1***", _URL_PASSWORD.sub(r"\1:***@", url))


def sqlite_path(url: str) -> str:
    """'sqlite:///rel.db' -> 'rel.db', 'sqlite:////abs/x.db' -> '/abs/x.db', a plain path as is."""
    return url.removeprefix("sqlite:///")


_NEW = "point buffer.trainer_input.experience_buffer.path at a new file (nothing was changed)"


def refuse_foreign(path: str, busy_timeout: float = 5.0) -> None:
    """DBMismatch, before anything is written, when `path` cannot hold this experience DB: a directory, a file that
    is not SQLite, a damaged one (garbage after the header, cut short), or another program's SQLite database (tables
    but no meta table, or a meta table of other columns). A path under a file is open_sqlite's to name (its folders
    cannot be made)."""
    if os.path.isdir(path):
        raise DBMismatch(f"{path} is a directory; {_NEW}")
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return
    with open(path, "rb") as f:
        head = f.read(100)
    if head[:16] != b"SQLite format 3\x00":
        raise DBMismatch(f"{path} is not a SQLite database; {_NEW}")
    page = int.from_bytes(head[16:18], "big") or 65536  # the header's page size (1 means 65536) and page count
    pages, valid = int.from_bytes(head[28:32], "big"), head[24:28] == head[92:96]
    # NOTE: not while a -wal file is there: a checkpoint in progress may write page 1 (the new size) first
    if len(head) < 100 or (valid and os.path.getsize(path) < page * pages and not os.path.exists(path + "-wal")):
        raise DBMismatch(
            f"{path} is a damaged SQLite database: cut short ({os.path.getsize(path)} bytes, its header "
            f"says {page * pages}); {_NEW}"
        )
    why = read_only(path)
    if why:  # NOTE: before opening it: SQLite cannot open a WAL file without writing its -shm ("unable to open")
        raise DBFault(
            f"experience DB {path}: it cannot be written ({why}); the file looks whole (a SQLite header) and nothing "
            "was changed. Make the file and its folder writable (or mount its file system read-write), or copy it "
            "to a writable place and point buffer.trainer_input.experience_buffer.path at the copy, then run again"
        )
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=busy_timeout)  # a foreign file stays as is
        try:
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            meta = {r[1]: r[5] for r in conn.execute("PRAGMA table_info(meta)")}  # column -> part of the primary key
        finally:
            conn.close()
    except sqlite3.DatabaseError as e:  # "file is not a database", "database disk image is malformed", ...
        busy = sqlite_busy(e, path, busy_timeout, "reading its tables")  # another process's lock: not damage
        raise busy or DBMismatch(f"{path} is a damaged SQLite database ({e}); {_NEW}") from None
    if tables and "meta" not in tables:
        raise DBMismatch(
            f"{path} is a SQLite database of another program (tables: {', '.join(sorted(tables))}); {_NEW}"
        )
    if "meta" in tables and (meta.get("key") != 1 or "value" not in meta):
        raise DBMismatch(
            f"{path} is a SQLite database of another program (its meta table has the columns "
            f"{', '.join(meta)}, not key (primary) and value); {_NEW}"
        )


def read_only(path: str) -> str:
    """Why the existing SQLite file at `path` cannot be written (its file system mounted read-only, the file or its
    folder without write permission for this process: SQLite writes -wal and -shm files beside it), or ''."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.statvfs(folder).f_flag & os.ST_RDONLY:
        return "its file system is mounted read-only"
    if not os.access(path, os.W_OK):
        return f"the file is read-only for this user (mode {os.stat(path).st_mode & 0o777:04o})"
    if not os.access(folder, os.W_OK) and not os.path.exists(path + "-shm"):
        return f"its folder {folder} is read-only for this user, and SQLite writes its -wal and -shm files there"
    return ""


def open_sqlite(path: str, busy_timeout: float) -> sqlite3.Connection:
    """A connection to the SQLite file at `path` (created if missing), in WAL mode."""
    refuse_foreign(path, busy_timeout)
    try:
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        # isolation_level=None: autocommit, so the module never opens transactions behind our
        # back; every write goes through `transaction` (BEGIN IMMEDIATE).
        conn = sqlite3.connect(path, timeout=busy_timeout, isolation_level=None)
        conn.execute("SELECT 1 FROM sqlite_master LIMIT 1")  # NOTE: connect() alone opens no file yet
    except (OSError, sqlite3.Error) as e:  # a read-only place (/proc), no permission, a file where a folder goes
        if isinstance(e, sqlite3.Error) and sqlite_busy(e, path, busy_timeout, "opening it"):
            raise sqlite_busy(e, path, busy_timeout, "opening it") from None  # type: ignore[misc]
        raise DBMismatch(
            f"cannot open or create the experience DB {path} ({e}): point "
            "buffer.trainer_input.experience_buffer.path at a file in a folder this process may write"
        ) from None
    # WAL: readers never block writers, nor vice versa. NOTE: switching a new file to WAL needs
    # an exclusive lock, and when several processes open the same new file at once SQLite
    # answers "database is locked" without waiting (deadlock avoidance), hence the retry.
    deadline = time.monotonic() + busy_timeout
    while True:
        try:
            with sqlite_faults(path):
                conn.execute("PRAGMA journal_mode=WAL")
            break
        except sqlite3.OperationalError as e:  # locked (a full disk or a damaged file left as DBFault above)
            if time.monotonic() > deadline:
                raise sqlite_busy(e, path, busy_timeout, "opening it (WAL mode)") or e from None
            time.sleep(0.01)
    # NORMAL: no fsync per commit; the WAL stays consistent, a power cut may lose the last commits.
    conn.execute("PRAGMA synchronous=NORMAL")
    return conn


def open_postgres(url: str, busy_timeout: float) -> Any:
    """A psycopg 3 connection in autocommit mode (transactions are opened explicitly), or a DBMismatch that says
    why there is none."""
    try:
        import psycopg
    except ImportError:
        raise DBMismatch(
            f"{shown(url)}: a PostgreSQL experience DB needs psycopg 3; install it with pip install -e '.[postgres]'"
        ) from None
    try:
        conn = psycopg.connect(url, autocommit=True, **link_timeouts(url, busy_timeout))
        # NOTE: a statement waiting for a lock (another session's, or a dead one's the server has not noticed yet)
        # fails after the busy timeout, as SQLite's does, instead of hanging the process
        conn.execute(f"SET lock_timeout = {max(1, round(busy_timeout * 1000))}")
        return conn
    except psycopg.Error as e:
        raise DBMismatch(
            f"cannot open the experience DB {shown(url)} (buffer.trainer_input.experience_buffer.path): {_reason(e)}"
        ) from None


BUSY_TIMEOUT_S = 60.0  # the experience DB's busy timeout (seconds) unless NANORFT_DB_TIMEOUT says otherwise
DB_TIMEOUT_ENV = "NANORFT_DB_TIMEOUT"
DEAD_LINK_S = 30  # a TCP connection to the server that goes unanswered this long (seconds) is lost (link_timeouts)
GONE_RETRY_S = 5.0  # how long a reopen waits for a server that this process already failed to reach (seconds)
_GONE: set[str] = set()  # the URLs this process could not reach again within their busy timeout (PostgresLink._reopen)

# what a lost connection's DBUnavailable says to do
_AGAIN = (
    " (check that the server runs and that this host reaches it: the link, a firewall, the address in the URL), then "
    "run the same command again: the run continues from what the DB holds"
)


def db_timeout() -> float:
    """The experience DB's busy timeout (seconds): $NANORFT_DB_TIMEOUT, else BUSY_TIMEOUT_S. How long a call waits for
    a lock another connection holds (SQLite's busy timeout, PostgreSQL's lock_timeout) and for a lost PostgreSQL
    server to take connections again; a dead network path to it is noticed after this or DEAD_LINK_S, the shorter
    (`link_timeouts`). Set it lower where a process cut from the DB should stop sooner (tests/test_hosts.py: 15 s),
    higher where the server may take longer to come back (a failover)."""
    value = os.environ.get(DB_TIMEOUT_ENV, "")
    if not value:
        return BUSY_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise DBMismatch(f"{DB_TIMEOUT_ENV}={value!r}: not a number of seconds above 0 (unset: {BUSY_TIMEOUT_S:g})")
    return seconds


def link_timeouts(url: str, busy_timeout: float) -> dict[str, int]:
    """libpq's connection parameters that bound how long a dead network path can hold a call: connect_timeout (the
    busy timeout); TCP keepalives (probes every 5 s after 10 s of silence), which end a call waiting for a reply from
    a host that went away, and tcp_user_timeout, which ends one whose sent data stays unacknowledged, both after
    DEAD_LINK_S (or the busy timeout, the shorter). A live server's host acknowledges at once, however busy the server:
    only a dead path or host goes that long unanswered. The URL's own values win. NOTE:
    without them a call on a cut link waited for the kernel's TCP retransmissions (~15 minutes: tcp_retries2), past
    every timeout of the run (tests/test_hosts.py). Unix sockets ignore the TCP ones."""
    import psycopg.conninfo

    seconds, dead = max(1, round(busy_timeout)), max(1, min(round(busy_timeout), DEAD_LINK_S))
    wanted = {
        "connect_timeout": seconds,
        "keepalives": 1,
        "keepalives_idle": 10,
        "keepalives_interval": 5,
        "keepalives_count": max(1, (dead - 10) // 5),
        "tcp_user_timeout": dead * 1000,
    }
    given = psycopg.conninfo.conninfo_to_dict(url)
    return {k: v for k, v in wanted.items() if k not in given}


def _reason(e: Exception) -> str:
    """An error's message on one line (psycopg's span several)."""
    return " ".join(str(e).split())


@contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Cursor]:
    """BEGIN IMMEDIATE ... COMMIT, ROLLBACK on any exception.

    IMMEDIATE takes the write lock up front (waiting up to the busy timeout). A plain BEGIN would
    start as a reader and fail with SQLITE_BUSY at its first write if another process wrote in
    between, without waiting."""
    cur = conn.cursor()
    cur.execute("BEGIN IMMEDIATE")
    try:
        yield cur
        cur.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            # NOTE: a damaged file or a failing disk may refuse the ROLLBACK too (SQLite then rolls back at the next
            # open, from the journal): the first error is the one that says why
            with contextlib.suppress(sqlite3.Error):
                cur.execute("ROLLBACK")
        raise


class Qmark:
    """A psycopg cursor that takes sqlite3's `?` placeholders, in which every statement here is written (psycopg
    wants %s; no statement here has a literal ? or %)."""

    def __init__(self, cur: Any) -> None:
        self.cur = cur

    def execute(self, sql: str, args: Any = ()) -> Qmark:
        self.cur.execute(sql.replace("?", "%s"), args)
        return self

    def executemany(self, sql: str, rows: list, returning: bool = False) -> Qmark:
        self.cur.executemany(sql.replace("?", "%s"), rows, returning=returning)
        return self

    def returned(self) -> list:
        """The first column of each statement's result after executemany(..., returning=True), in order."""
        out = [self.cur.fetchone()[0]]
        while self.cur.nextset():
            out.append(self.cur.fetchone()[0])
        return out

    def fetchone(self) -> Any:
        return self.cur.fetchone()

    def fetchall(self) -> list:
        return self.cur.fetchall()

    def __iter__(self) -> Iterator:
        return iter(self.cur)


class PostgresLink:
    """A psycopg 3 connection (autocommit; transactions opened explicitly) that is opened again when it is lost."""

    def __init__(self, url: str, busy_timeout: float) -> None:
        self.url, self.path, self.busy_timeout = url, shown(url), busy_timeout
        self.conn = open_postgres(url, busy_timeout)

    def run(self, body: Callable[[Any], T], atomic: bool) -> T:
        """body(cursor) on the connection (in one transaction if `atomic`); its result. A connection lost
        before COMMIT (the server rolled the transaction back), or during a read outside any transaction, is opened
        again (`_reopen`) and body runs once more. DBUnavailable when it was lost at COMMIT (committed or not is
        unknown: never run twice), lost again, or when a lock was waited for past the busy timeout. A transaction
        the server rolled back to break a deadlock runs again after a random pause (3 times at most)."""
        import psycopg

        retried, deadlocks = False, 0
        while True:
            if self.conn.closed:
                self.conn = self._reopen()
            committing = False
            try:
                with self.conn.cursor() as cur, self.conn.transaction() if atomic else contextlib.nullcontext():
                    out = body(Qmark(cur))
                    committing = atomic
                return out
            except (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure) as e:
                # The server rolled this transaction back to break a lock cycle: nothing of it was committed.
                if not atomic or deadlocks >= 3:
                    raise DBUnavailable(
                        f"{self.path}: a transaction was rolled back {deadlocks + 1} times to break a "
                        f"lock cycle ({_reason(e)})"
                    ) from None
                log.warning("%s: %s; running the transaction again", self.path, _reason(e))
                deadlocks += 1
                # NOTE: after a random pause: run again at once, the same two transactions were seen to form the same
                # cycle again (the server rolled back each of them in turn)
                time.sleep(random.uniform(0.01, 0.05) * 2**deadlocks)
            except (
                psycopg.errors.DiskFull,
                psycopg.errors.IoError,
                psycopg.errors.DataCorrupted,
                psycopg.errors.IndexCorrupted,
            ) as e:  # the server's disk or files: running again cannot help
                raise DBFault(
                    f"experience DB {self.path}: the PostgreSQL server cannot store or read it "
                    f"({_reason(e)}); what was committed before is kept, the failed transaction was rolled "
                    "back. Free space (or repair the disk) on the server, or restore the database from a "
                    "backup, then run again: the run continues from what the DB holds"
                ) from None
            except (psycopg.errors.LockNotAvailable, psycopg.errors.QueryCanceled) as e:
                raise self._busy(e) from None
            except psycopg.OperationalError as e:
                if not self.conn.broken:
                    raise
                if committing or retried:
                    raise DBUnavailable(
                        f"{self.path}: the connection to the PostgreSQL server was lost "
                        f"{'while a transaction committed' if committing else 'again'} ({_reason(e)})"
                        f"; restart once the server is back{_AGAIN}"
                    ) from None
                log.warning(
                    "%s: the connection to the PostgreSQL server was lost (%s); opening it again", self.path, _reason(e)
                )
                retried = True

    def _busy(self, e: Exception) -> DBBusy:
        """The DBBusy of a lock waited for past the busy timeout (lock_timeout: LockNotAvailable) or of a statement
        the server cancelled (statement_timeout, pg_cancel_backend: QueryCanceled)."""
        if type(e).__name__ == "LockNotAvailable":
            return DBBusy(
                f"{self.path}: waited more than {self.busy_timeout:g} s for a lock another session holds "
                f"({_reason(e)}); nothing of the waiting transaction was written. Find the session (pg_stat_activity, "
                "pg_locks), end it, then run again: the run continues from what the DB holds"
            )
        return DBBusy(
            f"{self.path}: the server cancelled a statement ({_reason(e)}): the statement_timeout of this role, "
            "database or URL (options=-c statement_timeout=...) is shorter than the experience DB's statements, or "
            "an administrator cancelled it; nothing of the transaction was written. Raise or unset statement_timeout "
            "for this DB (ALTER ROLE <user> SET statement_timeout = 0), then run again: the run continues from what "
            "the DB holds"
        )

    def _reopen(self) -> Any:
        """A new connection for a lost one, tried until the busy timeout runs out (a server restart takes seconds);
        GONE_RETRY_S only once this process has failed to reach the server that long. NOTE: a process stopping on
        DBUnavailable still writes to the DB on its way out (its lease, its state), each write on a connection of its
        own: waiting the busy timeout for each held an explorer cut from the server for minutes after its error."""
        budget = GONE_RETRY_S if self.url in _GONE else self.busy_timeout
        deadline = time.monotonic() + budget
        while True:
            try:
                conn = open_postgres(self.url, max(1.0, deadline - time.monotonic()))
                log.info("%s: connected again", self.path)
                _GONE.discard(self.url)
                return conn
            except DBMismatch as e:
                if time.monotonic() >= deadline:
                    _GONE.add(self.url)
                    raise DBUnavailable(
                        f"{self.path}: the connection to the PostgreSQL server was lost and could not "
                        f"be opened again in {budget:g} s: {e}{_AGAIN}"
                    ) from None
                time.sleep(0.5)

    def close(self) -> None:
        self.conn.close()
