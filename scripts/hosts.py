"""Hosts on one machine, for trying nanorft across machines without any: Linux network namespaces linked only to
each other through a switch of their own (tests/netns.py, which tests/test_hosts.py uses), addresses 198.18.0.<k>/24,
no route out. Nothing is added to the machine's own namespace. Needs root.

    python scripts/hosts.py up --hosts a,b         # namespaces nrftclia, nrftclib (+ nrftclisw: the switch)
    python scripts/hosts.py run b -- .venv/bin/python explore.py --config ...   # a command on host b
    python scripts/hosts.py cut b                  # b's cable out of the switch (packets dropped) ...
    python scripts/hosts.py mend b                 # ... and back in
    python scripts/hosts.py flap b --down 1 --every 5 --for 60   # b's link down 1 s in every 5, for a minute
    python scripts/hosts.py slow b --rate 8mbit    # what reaches b limited to 8 Mbit/s (tc tbf; "--rate ''" lifts it)
    python scripts/hosts.py lose b                 # every process on b SIGKILLed, b's namespace deleted
    python scripts/hosts.py down                   # every process on the hosts killed, every namespace deleted

A shell on a host: `python scripts/hosts.py run a -- bash`. The filesystem is the machine's (as a shared one would
be across machines); `--prefix` names another set of hosts. docs/scale-out.md shows a run across them.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import netns  # noqa: E402

PREFIX = "nrftcli"


def existing(prefix: str) -> list[str]:
    """The hosts of `prefix` that exist now (their names without the prefix; the switch not among them)."""
    listed = [line.split()[0] for line in netns.ip("netns", "list").stdout.splitlines() if line.split()]
    return sorted(n.removeprefix(prefix) for n in listed if n.startswith(prefix) and n != f"{prefix}sw")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", default=PREFIX, help="namespace names start with it (default %(default)s)")
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("up").add_argument("--hosts", default="a,b", help="2-3 host names, comma-separated")
    run = sub.add_parser("run")
    run.add_argument("host")
    run.add_argument("argv", nargs=argparse.REMAINDER)
    for name in ("cut", "mend", "lose"):
        sub.add_parser(name).add_argument("host")
    flap = sub.add_parser("flap")
    flap.add_argument("host")
    flap.add_argument("--down", type=float, default=1.0, help="seconds down each time")
    flap.add_argument("--every", type=float, default=5.0, help="one cut every so many seconds")
    flap.add_argument("--for", dest="total", type=float, default=60.0, help="seconds in all")
    slow = sub.add_parser("slow")
    slow.add_argument("host")
    slow.add_argument("--rate", default="8mbit", help="tc's units; '' lifts the limit")
    sub.add_parser("down")
    args = parser.parse_args(argv)
    if why := netns.missing():
        print(f"hosts: {why}", file=sys.stderr)
        return 2
    names = args.hosts.split(",") if args.what == "up" else existing(args.prefix)
    if args.what == "up" and names and existing(args.prefix):
        print(f"hosts: {args.prefix}* exist already: python {sys.argv[0]} down first", file=sys.stderr)
        return 2
    hosts = netns.Hosts(names, prefix=args.prefix)
    if args.what == "up":
        hosts.up()
        for h in names:
            print(f"{h}: {hosts.addr(h)} on {netns.IFACE} (namespace {hosts.ns(h)})")
        return 0
    if args.what == "down":
        hosts.made = [hosts.ns(h) for h in names] + [hosts.switch]
        hosts.down()
        return 0
    if args.host not in names:
        print(f"hosts: no host {args.host!r} (there are: {', '.join(names) or 'none'})", file=sys.stderr)
        return 2
    if args.what == "run":
        argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        return subprocess.run(hosts.command(args.host, argv or ["bash"])).returncode
    if args.what == "slow":
        hosts.throttle(args.host, args.rate)
        return 0
    if args.what == "flap":
        netns.flap(hosts, args.host, args.down, args.every, args.total, log=print)
        return 0
    {"cut": hosts.cut, "mend": hosts.mend, "lose": hosts.lose}[args.what](args.host)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
