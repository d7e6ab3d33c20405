"""lease.py: one owner per role. Each explorer (by its explorer.name) and the trainer hold a lease in the experience
DB; a launcher holds a lock on its run directory; the processes a launcher starts die with it.

    held = lease.hold(db, "explorer", "explorer")   # RoleTaken if a live process holds it; db's writes now fenced
    ...                                             # a daemon thread renews the heartbeat every BEAT_S seconds
    lease.release_all()                             # on the way out (launch.run_in_process does it)

Why: launching a job twice, or relaunching after the launcher was SIGKILLed, put two explorers of one name on one DB
(both read the same saved position: tasks explored and trained twice) and two trainers on one DB (the same steps
claimed, the same global_step_N folders written). Now:
- The lease is a row of the DB's `meta` table, `lease/explorer/<name>` or `lease/trainer` (so no schema change, and
  a DB of an earlier nanorft needs no upgrade): JSON of the holder's pid, host name, machine (boot id and pid
  namespace: a host name is not unique across containers), process start time, a random token and its heartbeat
  (unix time). A second claimant is refused by name (RoleTaken) while the holder lives; it takes the lease over when
  the heartbeat is older than STALE_S, or at once when the holder ran on this machine and its process is gone (a
  SIGKILLed explorer does not block its restart for STALE_S).
- Fencing: every transaction of the holder's ExperienceDB (its writes, claims, status) first checks, inside the same
  transaction, that the lease still carries its token (PostgreSQL: FOR SHARE, so a takeover waits for a write in
  flight). A process whose lease was taken over (it stalled past STALE_S) stops there with LeaseLost, a named error,
  and writes nothing. NOTE: heartbeats are unix times from each process's clock: hosts sharing a PostgreSQL DB need
  clocks that agree to well within STALE_S (NTP).
- The launcher's lock (`lock_dir`): fcntl.flock on <run dir>/launch.lock (launch_<role>.lock for one side of an
  asynchronous run), held while it runs; the kernel drops it when the process dies, however it dies.
- Children die with their launcher (`follow_launcher`, in each process the launcher starts, torchrun's ranks
  included): PR_SET_PDEATHSIG (SIGTERM when the parent dies; Linux) where the launcher is the parent, and a watchdog
  thread that polls the launcher's pid (and start time: a pid is reused) every second, for the ranks, whose parent is
  torchrun, and any process whose parent is not the launcher. On the launcher's death it sends this process SIGTERM
  (the entry points leave through their exit path: vLLM's engine processes stop), then SIGKILL after DEATH_GRACE_S.
  torchrun ends once its ranks have.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import logging
import os
import secrets
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

from buffer import DBMismatch, ExperienceDB

log = logging.getLogger("nanorft.lease")

STALE_S = 30.0  # a lease whose heartbeat is older than this (seconds) is taken over; the holder is presumed dead
BEAT_S = 5.0  # the holder renews its heartbeat this often (seconds): STALE_S / BEAT_S missed beats before takeover
DEATH_GRACE_S = 20.0  # after its launcher died, a child's SIGTERM has this long to end it before SIGKILL
LAUNCHER_PID = "NANORFT_LAUNCHER_PID"  # "<pid>:<start time>" of the launcher, in its children's environment


class RoleTaken(DBMismatch):
    """Another live process holds this role's lease (or this run directory's launcher lock)."""


class LeaseLost(DBMismatch):
    """This process's lease was taken over (its heartbeat went stale): it must stop without writing."""


# --- processes: who is alive


def machine() -> str:
    """This machine and pid namespace: the boot id and the pid namespace's inode (a host name alone is shared by
    containers whose pids are not comparable)."""
    parts = []
    for path in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid"):
        with contextlib.suppress(OSError):
            parts.append(os.readlink(path) if path.endswith("/pid") else Path(path).read_text().strip())
    return "/".join(parts) or socket.gethostname()


def stat(pid: int) -> tuple[str, int] | None:
    """(state, start time) of a process from /proc/<pid>/stat (fields 3 and 22: "Z" is a zombie, the start time is in
    clock ticks after boot): a pid and its start time identify a process, a pid alone is reused. None where unknown
    (no /proc, the process is gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # NOTE: the command name (field 2) may hold spaces and ")"
    return fields[0], int(fields[19])


def started(pid: int) -> int | None:
    """A process's start time (see `stat`), None where unknown."""
    got = stat(pid)
    return got[1] if got else None


def gone(pid: int, start: int | None) -> bool:
    """Whether the process `pid` (started at `start`, if known) of this machine no longer runs: no such pid, a zombie
    (killed, its parent has not reaped it yet), or the pid now names another process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        pass
    now = stat(pid)
    return now is not None and (now[0] == "Z" or (start is not None and now[1] != start))


# --- the lease in the DB


def lease_key(kind: str, name: str = "") -> str:
    """The meta key of a role's lease: lease/explorer/<name>, lease/trainer."""
    return f"lease/{kind}/{name}" if name else f"lease/{kind}"


def who(kind: str, name: str) -> str:
    return f"{kind} {name}" if name else f"the {kind}"


class Lease:
    """A role's lease, held: the heartbeat thread and the fence on the holder's ExperienceDB."""

    def __init__(self, db: ExperienceDB, kind: str, name: str, stale: float, beat: float) -> None:
        self.db, self.key, self.role, self.stale, self.beat = db, lease_key(kind, name), who(kind, name), stale, beat
        self.me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "machine": machine(),
            "started": started(os.getpid()),
            "token": secrets.token_hex(16),
            "since": time.time(),
        }
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None

    def record(self) -> str:
        return json.dumps({**self.me, "heartbeat": time.time()})

    def holder(self, cur: Any, lock: str = "") -> dict | None:
        """The lease's record as stored (None: no row), read in `cur`'s transaction."""
        row = cur.execute(f"SELECT value FROM meta WHERE key = ?{lock}", (self.key,)).fetchone()
        return json.loads(row[0]) if row else None

    def acquire(self, cur: Any) -> None:
        """In one transaction: the lease is ours, or RoleTaken naming its live holder."""
        cur.execute(
            "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO NOTHING", (self.key, self.record())
        )
        held = self.holder(cur, " FOR UPDATE" if self.db.postgres else "")
        if held["token"] == self.me["token"]:
            return
        age, dead = time.time() - held["heartbeat"], self.dead(held)
        if age <= self.stale and not dead:
            raise RoleTaken(
                f"{self.role} is already running: pid {held['pid']} on host {held['host']}, heartbeat {age:.0f} s ago "
                f"(experience DB {self.db.path}); stop it, or wait {max(self.stale - age, 0):.0f} s: a lease whose "
                f"heartbeat is older than {self.stale:g} s is taken over"
            )
        why = dead or f"its heartbeat is {age:.0f} s old (over {self.stale:g} s)"
        log.warning("%s: taking over the lease of pid %s on host %s: %s", self.role, held["pid"], held["host"], why)
        cur.execute("UPDATE meta SET value = ? WHERE key = ?", (self.record(), self.key))

    def dead(self, held: dict) -> str:
        """Why the holder is known dead without waiting for its heartbeat to go stale ("" if not known)."""
        if held.get("machine") != self.me["machine"]:
            return ""
        if held["pid"] == os.getpid():  # this process (a stage run again in one process): the old Lease is over
            return "it is this process's own, from an earlier stage or call"
        if gone(held["pid"], held.get("started")):
            return "its process is gone (same machine)"
        return ""

    def fence(self, cur: Any) -> None:
        """Inside each of the holder's transactions: LeaseLost unless the lease still carries our token."""
        held = self.holder(cur, " FOR SHARE" if self.db.postgres else "")
        if held is None or held["token"] != self.me["token"]:
            now = f"pid {held['pid']} on host {held['host']} holds it now" if held else "no one holds it now"
            raise LeaseLost(
                f"{self.role} lost its lease on the experience DB {self.db.path} ({now}): its heartbeat went "
                f"stale (over {self.stale:g} s: this process stalled or lost the DB), so another process took the "
                "role over. Stopping without writing; the other process continues from what the DB holds"
            )

    def renew(self, cur: Any) -> None:
        """The heartbeat: our record with the time now, unless the lease was taken over (then LeaseLost)."""
        self.fence(cur)
        cur.execute("UPDATE meta SET value = ? WHERE key = ?", (self.record(), self.key))

    def beating(self) -> None:
        """The heartbeat thread: renew every `beat` seconds on a connection of its own, until released or lost."""
        try:
            db = self.db.twin()  # NOTE: not ExperienceDB(url): see twin
        except Exception as e:
            log.error("%s: cannot open the DB for the lease's heartbeat: %s", self.role, e)
            return
        with db:
            while not self.stopping.wait(self.beat):
                try:
                    db._atomic(self.renew)
                except LeaseLost as e:
                    log.error("%s", e)
                    return
                except Exception as e:  # a DB that is busy or away for a moment: the next beat tries again
                    log.warning("%s: the lease's heartbeat failed (%s); trying again in %g s", self.role, e, self.beat)

    def release(self) -> None:
        """Stop the heartbeat, unfence the DB and delete the lease if it is still ours."""
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(timeout=self.beat + 5)
        if self.db.fence == self.fence:
            self.db.fence = None

        def body(cur: Any) -> None:
            held = self.holder(cur)
            if held is not None and held["token"] == self.me["token"]:
                cur.execute("DELETE FROM meta WHERE key = ?", (self.key,))

        try:  # NOTE: on the holder's own connection (this thread's), not a new one: see ExperienceDB.twin
            self.db._atomic(body)
        except Exception as e:  # the way out: the lease then goes stale, or its process is seen gone
            log.warning("%s: could not release its lease (%s)", self.role, e)
        if self in _HELD:
            _HELD.remove(self)


_HELD: list[Lease] = []


def hold(db: ExperienceDB, kind: str, name: str = "", stale: float = STALE_S, beat: float = BEAT_S) -> Lease:
    """Take role (`kind`, `name`)'s lease on `db` (RoleTaken if a live process holds it), fence db's transactions
    with it and start its heartbeat."""
    held = Lease(db, kind, name, stale, beat)
    db._atomic(held.acquire)
    db.fence = held.fence
    held.thread = threading.Thread(target=held.beating, daemon=True, name=f"lease-{held.key}")
    held.thread.start()
    _HELD.append(held)
    log.info("%s holds its lease on %s (pid %d, host %s)", held.role, db.path, os.getpid(), held.me["host"])
    return held


def release(db: ExperienceDB) -> None:
    """Release the leases this process holds on `db` (a clean exit: explore.finish, train.finish)."""
    for held in [h for h in _HELD if h.db is db]:
        held.release()


def release_all() -> None:
    """Release every lease this process holds (a stage's end, however it ended: launch.run_in_process)."""
    for held in list(_HELD):
        held.release()


# --- the launcher's lock on its run directory


def lock_dir(folder: Path, role: str = "") -> int:
    """An exclusive flock on <folder>/launch.lock (launch_<role>.lock), held until the returned fd is closed or this
    process dies; RoleTaken naming the launcher that holds it. NOTE: the fd is not inherited (os.open's default since
    Python 3.4): a child outliving the launcher would keep the lock."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (f"launch_{role}.lock" if role else "launch.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 200).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RoleTaken(
            f"{folder} is already being run by another launcher ({holder}); stop it first, or wait for it "
            f"to end (its lock: {path})"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
    return fd


# --- children die with their launcher


def launcher_env() -> dict[str, str]:
    """What the launcher puts in its children's environment so that they follow it (`follow_launcher`)."""
    return {LAUNCHER_PID: f"{os.getpid()}:{started(os.getpid())}"}


def follow_launcher() -> None:
    """In a process a launcher started (LAUNCHER_PID set; nothing otherwise): end when the launcher ends, however it
    ends. PR_SET_PDEATHSIG where the launcher is the parent (the signal comes at once), and a watchdog thread for
    every process, torchrun's ranks included (their parent is torchrun)."""
    given = os.environ.get(LAUNCHER_PID)
    if not given:
        return
    pid_text, _, start_text = given.partition(":")
    pid, start = int(pid_text), (int(start_text) if start_text.isdigit() else None)
    with contextlib.suppress(OSError, AttributeError):  # Linux only
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG, reset by fork and exec
    # NOTE: after prctl: a launcher that died before it finds no parent to signal its death, but is seen gone here
    threading.Thread(target=watch_launcher, args=(pid, start), daemon=True, name="launcher-watch").start()


def watch_launcher(pid: int, start: int | None, every: float = 1.0) -> None:
    while not gone(pid, start):
        time.sleep(every)
    log.error("the launcher (pid %d) is gone: this process stops (SIGTERM, SIGKILL after %g s)", pid, DEATH_GRACE_S)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(DEATH_GRACE_S)
    os.kill(os.getpid(), signal.SIGKILL)
