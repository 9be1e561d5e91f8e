"""A fake Hugging Face Hub on 127.0.0.1: just what huggingface_hub 2.x's `snapshot_download` asks for.

It serves repos held in memory, {repo_id: {filename: bytes}}, over plain HTTP (no Xet headers, so
the client never takes its Xet path); those named in `datasets` as datasets, the others as models:

    GET  /api/models/{repo}[/revision/{rev}]   repo info: the commit sha and the file names
    GET  /api/models/{repo}/tree/{rev}[/...]   the file listing (path, size, git blob id)
    HEAD /{repo}/resolve/{rev}/{file}          file metadata: X-Repo-Commit, ETag, Content-Length
    GET  /{repo}/resolve/{rev}/{file}          the file, `Range: bytes=N-` answered with a 206

(datasets: /api/datasets/... and /datasets/{repo}/resolve/...)

Errors are the Hub's: an unknown repo is a 404 with `X-Error-Code: RepoNotFound`, an unknown revision
`RevisionNotFound`, a missing file `EntryNotFound`. A gated repo shows its info and listing but answers
file requests with 401 `X-Error-Code: GatedRepo`, as the Hub does for anonymous users.

Faults, for testing resumption: `cut[(repo, file)] = k` makes the next k plain GETs of that file announce
the whole Content-Length, send half the bytes and drop the connection; `fail_ranged[(repo, file)] = k`
answers the next k ranged GETs with a 500; `stall[(repo, file)] = event` sends half the file, then the
rest once the event is set. Every request is logged in `log` as (method, path, Range).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

INFO = re.compile(r"/api/(?P<kind>models|datasets)/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?")
TREE = re.compile(r"/api/(?P<kind>models|datasets)/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)(?:/.*)?")
RESOLVE = re.compile(r"(?:/(?P<kind>datasets))?/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)")


class FakeHub:
    def __init__(self, repos: dict[str, dict[str, bytes]], gated=(), datasets=()):
        self.repos, self.gated, self.datasets = repos, set(gated), set(datasets)
        self.cut: dict[tuple[str, str], int] = {}
        self.fail_ranged: dict[tuple[str, str], int] = {}
        self.stall: dict[tuple[str, str], threading.Event] = {}  # half a file, then wait for the event
        self.log: list[tuple[str, str, str | None]] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.server.daemon_threads = False  # server_close() then joins every handler thread
        self.server.hub = self
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self._thread = threading.Thread(
            target=self.server.serve_forever, args=(0.05,), name="fakehub", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        self.server.shutdown()
        self.server.server_close()
        self._thread.join()

    @staticmethod
    def commit(repo: str) -> str:
        return hashlib.sha1(repo.encode()).hexdigest()

    def file_requests(self, repo: str, method: str = "GET") -> list[tuple[str, str, str | None]]:
        with self.lock:
            return [r for r in self.log if r[0] == method and r[1].startswith(f"/{repo}/resolve/")]

    def _take(self, faults: dict, key) -> bool:
        with self.lock:
            if faults.get(key, 0) > 0:
                faults[key] -= 1
                return True
            return False


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # one request per connection: no idle keep-alive threads

    def log_message(self, *args):  # quiet
        pass

    def do_HEAD(self):
        self._route()

    def do_GET(self):
        self._route()

    def _route(self):
        hub: FakeHub = self.server.hub
        path = unquote(urlsplit(self.path).path)
        with hub.lock:
            hub.log.append((self.command, path, self.headers.get("Range")))
        for pattern, serve in ((TREE, self._tree), (INFO, self._info), (RESOLVE, self._file)):
            m = pattern.fullmatch(path)
            if m:
                repo, rev = m["repo"], m["rev"] or "main"
                if repo not in hub.repos or (m["kind"] == "datasets") != (repo in hub.datasets):
                    return self._error(404, "RepoNotFound", "Repository not found")
                if rev not in ("main", hub.commit(repo)):
                    return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
                return serve(hub, repo, m)
        self._error(404, None, "Sorry, we can't find the page you are looking for.")

    def _info(self, hub, repo, m):
        files = hub.repos[repo]
        self._json(
            {
                "id": repo,
                "sha": hub.commit(repo),
                "private": False,
                "gated": "manual" if repo in hub.gated else False,
                "siblings": [{"rfilename": name} for name in files],
            }
        )

    def _tree(self, hub, repo, m):
        self._json(
            [
                {
                    "type": "file",
                    "path": name,
                    "size": len(data),
                    "oid": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest(),
                }
                for name, data in hub.repos[repo].items()
            ]
        )

    def _file(self, hub, repo, m):
        name, commit = m["file"], hub.commit(repo)
        if repo in hub.gated:
            return self._error(
                401,
                "GatedRepo",
                f"Access to model {repo} is restricted. You must have access "
                "to it and be authenticated to access it. Please log in.",
                commit,
            )
        data = hub.repos[repo].get(name)
        if data is None:
            return self._error(404, "EntryNotFound", f'{name} does not exist on "main"', commit)
        ranged = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
        start = int(ranged[1]) if ranged and self.command == "GET" else 0
        if start and hub._take(hub.fail_ranged, (repo, name)):
            return self._error(500, None, "Internal Error", commit)
        cut = self.command == "GET" and not start and hub._take(hub.cut, (repo, name))
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", commit)
        self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(data) - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if self.command == "GET" and (repo, name) in hub.stall and not start:
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            hub.stall[(repo, name)].wait(60)  # (a slow download's middle)
            self.wfile.write(data[len(data) // 2 :])
        elif self.command == "GET":
            self.wfile.write(data[start : len(data) // 2] if cut else data[start:])
            # when cut: returning closes the socket with the body half sent

    def _json(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(body)

    def _error(self, status, code, message, commit=None):
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        if commit:
            self.send_header("X-Repo-Commit", commit)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(body)
