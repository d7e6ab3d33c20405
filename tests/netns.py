"""Hosts for the tests and for people: Linux network namespaces linked only to each other, as separate machines on
one LAN (tests/test_hosts.py; `python scripts/hosts.py` for a shell on them).

    with Hosts(["a", "b"]) as hosts:              # namespaces nrft<pid>a, nrft<pid>b and a switch nrft<pid>sw
        hosts.addr("a")                           # 198.18.0.1 (198.18.0.0/15: the range set aside for such tests)
        proc = hosts.popen("b", [python, "explore.py", ...])   # a process on host b
        hosts.cut("b"); hosts.mend("b")           # b's cable out of the switch, and back in
        hosts.lose("b")                           # b's processes SIGKILLed, its namespace deleted

The layout: a namespace per host with `lo` and `eth0` (198.18.0.<k>/24, no default route: nothing outside is
reachable), and a switch namespace holding a bridge with one veth port per host. Every device is made inside the
namespaces (`ip -n SWITCH link add PORT type veth peer name eth0 netns HOST`): the machine's own namespace never holds
one, nor an address or a route. The filesystem is shared (a shared filesystem, as NFS would be across machines), and
unix sockets too (the tests read the DB through the server's socket). `cut` takes a host's switch port down: its
packets are dropped from then on (no error, as when a cable is pulled), its connections time out unless the link comes
back first. Namespace names carry the pid of the process that made them (`nrft<pid>`): `sweep` removes those of dead
processes (a run SIGKILLed before its teardown).

Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN) and iproute2's `ip` and util-linux's `nsenter`: `missing()` says why not.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time

PREFIX = "nrft"  # every namespace made here starts with it, then the pid of the process that made it
NET = "198.18.0"  # host k (from 1) is NET.k/24
IFACE = "eth0"  # the hosts' link, for GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and out.returncode:
        raise RuntimeError(f"ip {' '.join(args)} failed: {out.stderr.strip()}")
    return out


def missing() -> str:
    """Why no namespace can be made here ("" if one can): not root, no `ip` or `nsenter`, or `ip netns add` refused
    (a container without CAP_SYS_ADMIN)."""
    gone = [p for p in ("ip", "nsenter") if shutil.which(p) is None]
    if gone:
        return f"{', '.join(gone)} not found (apt-get install iproute2 util-linux)"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    probe = f"{PREFIX}{os.getpid()}probe"
    made = ip("netns", "add", probe, check=False)
    if made.returncode:
        return f"ip netns add failed: {made.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return ""


def sweep() -> list[str]:
    """Delete the namespaces that a process which is gone made (`nrft<pid>...`, the pid dead), killing what still
    runs in them; returns their names."""
    gone = []
    for line in ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        rest = name.removeprefix(PREFIX) if name.startswith(PREFIX) else ""
        pid = rest[: len(rest) - len(rest.lstrip("0123456789"))]
        if pid and not os.path.exists(f"/proc/{pid}"):
            kill_all(name)
            ip("netns", "del", name, check=False)
            gone.append(name)
    return gone


def pids(namespace: str) -> list[int]:
    """The processes whose network namespace is `namespace`."""
    out = ip("netns", "pids", namespace, check=False)
    return [int(p) for p in out.stdout.split()] if out.returncode == 0 else []


def kill_all(namespace: str, timeout: float = 10.0) -> None:
    """SIGKILL every process in `namespace` (again, for those forked meanwhile) until none is left."""
    deadline = time.monotonic() + timeout
    while (left := pids(namespace)) and time.monotonic() < deadline:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


class Hosts:
    """Hosts named `names` (2-3 of them), each its own network namespace on one switch; `up()` makes them, `down()`
    removes every namespace and process, also after a failure half-way through `up()`."""

    def __init__(self, names: list[str], prefix: str = "") -> None:
        self.prefix = prefix or f"{PREFIX}{os.getpid()}"
        self.names = list(names)
        self.switch = f"{self.prefix}sw"
        self.made: list[str] = []  # the namespaces made so far (down() deletes these)

    def ns(self, host: str) -> str:
        return f"{self.prefix}{host}"

    def addr(self, host: str) -> str:
        return f"{NET}.{self.names.index(host) + 1}"

    def up(self) -> Hosts:
        try:
            self._add(self.switch)
            ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            ip("-n", self.switch, "link", "set", "br0", "up")
            for host in self.names:
                ns = self._add(self.ns(host))
                port = f"p{host}"
                ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", IFACE, "netns", ns)
                ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
                ip("-n", ns, "addr", "add", f"{self.addr(host)}/24", "dev", IFACE)
                ip("-n", ns, "link", "set", IFACE, "up")
                ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.down()
            raise
        return self

    def _add(self, ns: str) -> str:
        ip("netns", "add", ns)
        self.made.append(ns)
        return ns

    def command(self, host: str, argv: list[str], user: str | None = None) -> list[str]:
        """argv run on `host` (in its namespace), as `user` if given (nsenter changes user after entering it)."""
        cmd = ["nsenter", f"--net=/run/netns/{self.ns(host)}"]
        if user is not None:
            import pwd

            entry = pwd.getpwnam(user)
            cmd += [f"--setuid={entry.pw_uid}", f"--setgid={entry.pw_gid}"]
        return [*cmd, "--", *argv]

    def popen(self, host: str, argv: list[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(self.command(host, argv), **kw)

    def cut(self, host: str) -> None:
        """Pull `host`'s cable: its switch port down; nothing it sends or is sent arrives until `mend`."""
        ip("-n", self.switch, "link", "set", f"p{host}", "down")

    def mend(self, host: str) -> None:
        ip("-n", self.switch, "link", "set", f"p{host}", "up")

    def throttle(self, host: str, rate: str = "") -> None:
        """What the switch sends to `host` limited to `rate` (tc's units: "8mbit"), queued up to 400 ms, then
        dropped: a slow link (tc's tbf; this kernel has no netem for delay or random loss). "" lifts the limit."""
        port = ["dev", f"p{host}", "root"]
        if rate:
            ip(
                "netns",
                "exec",
                self.switch,
                "tc",
                "qdisc",
                "replace",
                *port,
                "tbf",
                "rate",
                rate,
                "burst",
                "32kbit",
                "latency",
                "400ms",
            )
        else:
            ip("netns", "exec", self.switch, "tc", "qdisc", "del", *port, check=False)

    def lose(self, host: str) -> None:
        """The host is gone: every process on it SIGKILLed at once, its namespace (and link) deleted."""
        kill_all(self.ns(host))
        ip("netns", "del", self.ns(host), check=False)
        self.made = [n for n in self.made if n != self.ns(host)]

    def down(self) -> None:
        """Kill every process in the namespaces and delete them (the hosts first, then the switch)."""
        for ns in sorted(self.made, key=lambda n: n == self.switch):
            kill_all(ns)
            ip("netns", "del", ns, check=False)
        self.made = []

    def __enter__(self) -> Hosts:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()


def flap(
    hosts: Hosts,
    host: str,
    down: float = 1.0,
    every: float = 5.0,
    total: float = 60.0,
    stop: threading.Event | None = None,
    log=None,
) -> int:
    """A flapping link: `host` cut for `down` s at the start of every `every` s, for `total` s (or until `stop` is
    set); returns the number of cuts. The link is up when it returns."""
    stop = stop or threading.Event()
    start, cuts = time.monotonic(), 0
    while time.monotonic() - start < total and not stop.is_set():
        hosts.cut(host)
        cuts += 1
        if log:
            log(f"{host}: link down ({cuts})")
        stop.wait(down)
        hosts.mend(host)
        stop.wait(max(0.0, start + cuts * every - time.monotonic()))
    return cuts
