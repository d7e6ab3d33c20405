"""A stand-in for the Hugging Face hub over HF_ENDPOINT, for tests of configs/hub.py's download path: it serves local
folders as model and dataset repos, with the requests huggingface_hub's snapshot_download and `datasets`'
load_dataset make (a repo's info with its file list, its file tree, HEAD and GET of each file's resolve URL, with the
headers they read). Every request is recorded in `requests` (method, path). Also the two endpoints a machine without
hub access meets: a closed port, and one that accepts connections and never answers.

    with FakeHub({"org/tiny": folder, "datasets/org/sft": data}) as hub:   # hub.url: http://127.0.0.1:<port>
        ...  HF_ENDPOINT=hub.url ...
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "c" * 40  # the one revision the fake repo has


class FakeHub:
    """The repos `repos` ({"org/name": model folder, "datasets/org/name": dataset folder}) over HTTP at `url`."""

    def __init__(self, repos: dict[str, str | Path]) -> None:
        self.repos, self.requests = {k: Path(v) for k, v in repos.items()}, []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_HEAD(self) -> None:
                hub.requests.append(("HEAD", self.path))
                self._answer(body=False)

            def do_GET(self) -> None:
                hub.requests.append(("GET", self.path))
                self._answer(body=True)

            def _answer(self, body: bool) -> None:
                status, headers, data = hub.answer(self.path.split("?")[0])
                self.send_response(status)
                for k, v in {**headers, "Content-Length": str(len(data))}.items():
                    self.send_header(k, v)
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def log_message(self, *args) -> None:  # no per-request lines on the test's stderr
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def answer(self, path: str) -> tuple[int, dict, bytes]:
        """(status, headers, body) for a request path: a repo's info (its files), its file tree, one of its files."""
        for key, folder in self.repos.items():
            kind, repo = ("dataset", key[len("datasets/") :]) if key.startswith("datasets/") else ("model", key)
            sizes = {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}
            info = f"/api/{kind}s/{repo}"
            if path in (info, f"{info}/revision/main", f"{info}/revision/{COMMIT}"):
                siblings = [{"rfilename": f, "size": n} for f, n in sizes.items()]
                about = {"id": repo, "sha": COMMIT, "siblings": siblings, "private": False}
                return 200, {"Content-Type": "application/json"}, json.dumps(about).encode()
            if path in (f"{info}/tree/main", f"{info}/tree/{COMMIT}"):
                tree = [{"type": "file", "path": f, "size": n, "oid": "0" * 40} for f, n in sizes.items()]
                return 200, {"Content-Type": "application/json"}, json.dumps(tree).encode()
            for rev in ("main", COMMIT):
                name = path.removeprefix(f"/{key}/resolve/{rev}/")
                if name != path and name in sizes:
                    data = (folder / name).read_bytes()
                    return 200, {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}, data
        known = any(f"/{key}/" in path.replace("/api/datasets/", "/datasets/") for key in self.repos)
        missing = "RepoNotFound" if path.startswith("/api/") and not known else "EntryNotFound"  # as the hub says
        return 404, {"X-Error-Code": missing}, b"{}"

    def __enter__(self) -> FakeHub:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def closed_port() -> str:
    """An endpoint on a local port nothing listens on: connections are refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


class SilentPort:
    """An endpoint that accepts connections (the kernel's backlog) and never answers: a hub behind a black-holing
    proxy, which only a timeout ends."""

    def __enter__(self) -> str:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def __exit__(self, *exc) -> None:
        self.sock.close()
