"""A local stand-in for the Hugging Face Hub: a real HTTP server (http.server in a thread) that
answers the requests `huggingface_hub` makes for a model, in the Hub's shape, so that tests run the
real client (HF_ENDPOINT points here) and never reach the internet.

What it speaks (as huggingface_hub 1.x/2.x's hf_api.model_info, file_download.get_hf_file_metadata
and http_get send and read them):

    GET  /api/models/{repo}[/revision/{rev}][?blobs=true]
         {"id", "sha", "siblings": [{"rfilename"[, "size", "blobId", "lfs": {"size", "sha256",
         "pointerSize"}]}], "gated", ...}
    HEAD|GET /{repo}/resolve/{rev}/{file}
         a small (git) file: 200 with ETag = its git blob id, Content-Length, X-Repo-Commit; asked
         by a branch or tag name, first a 307 to the same file at its commit (a same-host
         redirect the client follows).
         a large (LFS) file: 302 to a "CDN" on another origin (localhost instead of 127.0.0.1), with
         X-Linked-Etag = its sha256, X-Linked-Size, X-Repo-Commit (the client stops at that
         redirect for the metadata, then GETs the CDN url without the auth header).
    GET  /cdn/{sha256}   the bytes, with Range requests (206 + Content-Range)

and the Hub's errors by X-Error-Code: RepoNotFound (401, as the Hub answers an unauthenticated
client), RevisionNotFound (404), EntryNotFound (404, with X-Repo-Commit), GatedRepo (401 without
the repository's token). Faults for tests: `corrupt` (a file served with its bytes changed, the
listed checksum kept), `cut_once` (the first GET of a file stops at 60%: the client resumes
with a Range request). Every request is recorded in `requests` as (method, path, Range header).
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

LFS_SUFFIXES = (".gguf", ".safetensors", ".bin")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _commit_id(repo_id: str, files: dict[str, bytes], parent: str | None) -> str:
    digest = hashlib.sha1((repo_id + (parent or "")).encode())
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    return digest.hexdigest()


@dataclass
class Repo:
    repo_id: str
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # sha -> files
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> sha
    gated_token: str | None = None  # gated: only this token may download

    def commit(self, revision: str) -> str | None:
        if revision in self.commits:
            return revision
        return self.refs.get(revision)


class HubStandin:
    """`with HubStandin() as hub: hub.add_repo(...); os.environ["HF_ENDPOINT"] = hub.url`."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.blobs: dict[str, bytes] = {}  # sha256 -> bytes (the CDN)
        self.corrupt: set[str] = set()  # file names served with changed bytes
        self.cut_once: set[str] = set()  # file names whose first GET stops at 60%
        self.requests: list[tuple[str, str, str | None]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.cdn_url = f"http://localhost:{self.port}/cdn"  # another origin: the Hub's CDN is one too
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> HubStandin:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def add_repo(self, repo_id: str, files: dict[str, bytes | Path], tag: str | None = None,
                 gated_token: str | None = None) -> str:
        """Commit `files` as the repository's new main (a new repository, or a new commit of it;
        `tag` names this commit too); returns the commit's sha."""
        repo = self.repos.setdefault(repo_id, Repo(repo_id))
        repo.gated_token = gated_token or repo.gated_token
        contents = {name: data.read_bytes() if isinstance(data, Path) else data for name, data in files.items()}
        sha = _commit_id(repo_id, contents, repo.refs.get("main"))
        repo.commits[sha] = contents
        repo.refs["main"] = sha
        if tag:
            repo.refs[tag] = sha
        for data in contents.values():
            self.blobs[hashlib.sha256(data).hexdigest()] = data
        return sha

    def paths(self, method: str | None = None) -> list[str]:
        return [path for m, path, _ in self.requests if method is None or m == method]


def _is_lfs(name: str) -> bool:
    return name.endswith(LFS_SUFFIXES)


def _sibling(name: str, data: bytes, blobs: bool) -> dict:
    entry: dict = {"rfilename": name}
    if blobs:
        entry["size"] = len(data)
        if _is_lfs(name):
            pointer = (f"version https://git-lfs.github.com/spec/v1\noid sha256:{hashlib.sha256(data).hexdigest()}\n"
                       f"size {len(data)}\n").encode()
            entry["blobId"] = git_blob_id(pointer)
            entry["lfs"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pointerSize": len(pointer)}
        else:
            entry["blobId"] = git_blob_id(data)
    return entry


def _handler(hub: HubStandin) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # quiet: the tests read hub.requests
            pass

        def do_HEAD(self) -> None:
            self._answer(head=True)

        def do_GET(self) -> None:
            self._answer(head=False)

        # -- helpers ------------------------------------------------------------------------
        def _send(self, status: int, headers: dict[str, str], body: bytes = b"", head: bool = False,
                  length: int | None = None) -> None:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body) if length is None else length))
            self.end_headers()
            if not head and body:
                self.wfile.write(body)

        def _error(self, status: int, code: str, message: str, head: bool, commit: str | None = None) -> None:
            headers = {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json"}
            if commit:
                headers["X-Repo-Commit"] = commit
            self._send(status, headers, json.dumps({"error": message}).encode(), head)

        def _token(self) -> str | None:
            auth = self.headers.get("Authorization", "")
            return auth.removeprefix("Bearer ").strip() or None

        def _answer(self, head: bool) -> None:
            url = urlsplit(self.path)
            path = unquote(url.path)
            hub.requests.append((self.command, self.path, self.headers.get("Range")))
            if url.path.startswith("/api/models/"):
                return self._model_info(url.path.removeprefix("/api/models/"), "blobs=true" in url.query, head)
            if url.path.startswith("/cdn/"):
                return self._cdn(url.path.removeprefix("/cdn/"), url.query, head)
            if "/resolve/" in path:
                return self._resolve(url.path, head)
            self._error(404, "NotFound", f"no route {path}", head)

        def _model_info(self, rest: str, blobs: bool, head: bool) -> None:
            repo_id, _, revision = rest.partition("/revision/")
            repo = hub.repos.get(unquote(repo_id))
            if repo is None:
                return self._error(401, "RepoNotFound", "Repository not found", head)
            sha = repo.commit(unquote(revision) if revision else "main")
            if sha is None:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {unquote(revision)}", head)
            files = repo.commits[sha]
            body = {"_id": sha[:24], "id": repo.repo_id, "modelId": repo.repo_id, "author": repo.repo_id.split("/")[0],
                    "sha": sha, "private": False, "gated": "manual" if repo.gated_token else False,
                    "disabled": False, "tags": ["gguf"] if any(n.endswith(".gguf") for n in files) else [],
                    "lastModified": "2026-01-01T00:00:00.000Z",
                    "siblings": [_sibling(name, files[name], blobs) for name in sorted(files)]}
            self._send(200, {"Content-Type": "application/json"}, json.dumps(body).encode(), head)

        def _resolve(self, raw_path: str, head: bool) -> None:
            # /{user}/{repo}/resolve/{revision (quoted)}/{file}
            before, _, after = raw_path.lstrip("/").partition("/resolve/")
            repo = hub.repos.get(unquote(before))
            if repo is None:
                return self._error(401, "RepoNotFound", "Repository not found", head)
            quoted_revision, _, quoted_name = after.partition("/")
            revision, name = unquote(quoted_revision), unquote(quoted_name)
            sha = repo.commit(revision)
            if sha is None:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", head)
            files = repo.commits[sha]
            if name not in files:
                return self._error(404, "EntryNotFound", f"{name} does not exist on {revision}", head, sha)
            if repo.gated_token is not None and self._token() != repo.gated_token:
                return self._error(401, "GatedRepo", "Access to model is restricted; you must be authenticated",
                                   head)
            data = files[name]
            common = {"X-Repo-Commit": sha, "Accept-Ranges": "bytes"}
            if _is_lfs(name):
                digest = hashlib.sha256(data).hexdigest()
                location = f"{hub.cdn_url}/{digest}?name={quote(name)}"
                return self._send(302, common | {"Location": location, "X-Linked-Etag": f'"{digest}"',
                                                 "X-Linked-Size": str(len(data)), "ETag": f'"{git_blob_id(data)}"'},
                                  head=head)
            if sha != revision:  # a branch or tag: to the file at its commit, on this host
                return self._send(307, common | {"Location": f"/{before}/resolve/{sha}/{quoted_name}"}, head=head)
            body = data if name not in hub.corrupt else _corrupted(data)
            self._send(200, common | {"ETag": f'"{git_blob_id(data)}"'}, body, head)

        def _cdn(self, digest: str, query: str, head: bool) -> None:
            data = hub.blobs.get(digest)
            if data is None:
                return self._send(404, {}, b"no such blob", head)
            name = unquote(query.removeprefix("name="))
            if name in hub.corrupt:
                data = _corrupted(data)
            start = 0
            status, headers = 200, {"ETag": f'"{digest}"', "Accept-Ranges": "bytes",
                                    "Content-Type": "application/octet-stream"}
            ranged = self.headers.get("Range")
            if ranged and ranged.startswith("bytes="):
                first, _, last = ranged.removeprefix("bytes=").partition("-")
                start, end = int(first), (int(last) if last else len(data) - 1)
                headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
                data, status = data[start:end + 1], 206
            if not head and name in hub.cut_once and start == 0:
                hub.cut_once.discard(name)  # the whole length announced, 60% sent, the connection dropped
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data[:len(data) * 6 // 10])
                self.wfile.flush()
                self.close_connection = True
                return
            self._send(status, headers, data, head)

    return Handler


def _corrupted(data: bytes) -> bytes:
    """The same length, one byte in the middle changed (what a flaky disk or proxy does)."""
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:]
