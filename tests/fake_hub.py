"""A stand-in for the Hugging Face hub over HF_ENDPOINT, for tests of configs/hub.py's download path: it serves one
local model folder as model repo `repo`, with the requests huggingface_hub's snapshot_download makes (the repo's
info with its file list, then HEAD and GET of each file's resolve URL, with the headers it reads). Every request is
recorded in `requests` (method, path). Also the two endpoints a machine without hub access meets: a closed port and one
that accepts connections and never answers.

    with FakeHub(folder, "org/tiny") as hub:   # hub.url: http://127.0.0.1:<port>
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
    def __init__(self, folder: str | Path, repo: str) -> None:
        self.folder, self.repo, self.requests = Path(folder), repo, []
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

    def sizes(self) -> dict[str, int]:
        """The repo's files: {path in the repo: size in bytes}."""
        return {
            str(p.relative_to(self.folder)): p.stat().st_size for p in sorted(self.folder.rglob("*")) if p.is_file()
        }

    def answer(self, path: str) -> tuple[int, dict, bytes]:
        """(status, headers, body) for a request path."""
        info = f"/api/models/{self.repo}"
        if path in (info, f"{info}/revision/main", f"{info}/revision/{COMMIT}"):
            siblings = [{"rfilename": f, "size": s} for f, s in self.sizes().items()]
            return (
                200,
                {"Content-Type": "application/json"},
                json.dumps({"id": self.repo, "sha": COMMIT, "siblings": siblings, "private": False}).encode(),
            )
        if path in (f"{info}/tree/main", f"{info}/tree/{COMMIT}"):
            tree = [{"type": "file", "path": f, "size": s, "oid": "0" * 40} for f, s in self.sizes().items()]
            return 200, {"Content-Type": "application/json"}, json.dumps(tree).encode()
        for rev in ("main", COMMIT):
            prefix = f"/{self.repo}/resolve/{rev}/"
            if path.startswith(prefix) and (self.folder / path[len(prefix) :]).is_file():
                data = (self.folder / path[len(prefix) :]).read_bytes()
                etag = hashlib.sha256(data).hexdigest()
                return 200, {"X-Repo-Commit": COMMIT, "ETag": f'"{etag}"'}, data
        return 404, {"X-Error-Code": "EntryNotFound"}, b"{}"

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
