"""`python -m studio`: serve the studio (Streamlit) on loopback, or on another address with a key.

python -m studio                                   # http://127.0.0.1:8501
python -m studio --port 8600
python -m studio --host 0.0.0.0 --key "$KEY"       # off loopback: a key is required (or NANORFT_STUDIO_KEY)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from configs.checks import loopback
from studio.access import KEY_ENV

APP = Path(__file__).resolve().parent / "app.py"


def streamlit_argv(host: str, port: int) -> list[str]:
    """The `streamlit run` command line that serves the app on host:port, headless, without usage statistics."""
    return [
        sys.executable, "-m", "streamlit", "run", str(APP),
        "--server.address", host, "--server.port", str(port), "--server.headless", "true",
        "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none", "--client.toolbarMode", "minimal",
    ]  # fmt: skip


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m studio", description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback: this machine only)")
    ap.add_argument("--port", type=int, default=8501)
    ap.add_argument("--key", default=os.environ.get(KEY_ENV), help=f"key a browser must send (default ${KEY_ENV})")
    args = ap.parse_args(argv)
    if not loopback(args.host) and not args.key:
        print(
            f"studio: {args.host!r} is not loopback: anyone who reaches it could read your configs and DBs; "
            f"give a key (--key or ${KEY_ENV}) and open http://HOST:PORT/?key=KEY",
            file=sys.stderr,
        )
        return 2
    env = dict(os.environ)
    env.pop(KEY_ENV, None)
    if args.key:
        env[KEY_ENV] = args.key
    print(f"studio: http://{args.host}:{args.port}/{'?key=...' if args.key else ''}", flush=True)
    os.execve(sys.executable, streamlit_argv(args.host, args.port), env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
