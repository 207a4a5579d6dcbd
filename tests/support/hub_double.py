"""A protocol double of the Hugging Face Hub for the push tests: NOT the Hub.

A small HTTP server on 127.0.0.1 that answers the endpoints ``huggingface_hub`` 2.4's ``HfApi``
calls for a push, with the payloads its client code sends and parses (read from its source):

- ``GET  /api/whoami-v2``                                   who the bearer token belongs to
- ``POST /api/repos/create``                                 409 when the repo exists, 403 outside your namespaces
- ``GET  /api/models/{repo}[/revision/{rev}]``               repo info (head ``sha``, siblings)
- ``POST /api/models/{repo}/branch/{branch}``                create a branch (409 when it exists)
- ``POST /api/validate-yaml``                                README.md metadata check
- ``POST /api/models/{repo}/preupload/{rev}``                upload mode per file, remote oid when present
- ``POST /{repo}.git/info/lfs/objects/batch`` + ``PUT /lfs-upload/{oid}``   LFS basic transfer
- ``POST /api/models/{repo}/commit/{rev}``                   NDJSON commit (``?create_pr=1`` opens a PR)
- ``GET  /api/models/{repo}/tree/{rev}``                     file listing with sizes, git oids, LFS sha256

Large files go through LFS, as on the Hub; the double does not speak Xet, so tests turn Xet off
(``huggingface_hub.constants.HF_HUB_DISABLE_XET``) and the client falls back to LFS. Everything it
receives is kept in memory for the tests to inspect.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

LFS_SUFFIXES = (".safetensors", ".png", ".bin")
GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.png filter=lfs diff=lfs merge=lfs -text\n"


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass(frozen=True)
class Blob:
    data: bytes
    lfs: bool

    def tree_entry(self, path: str) -> dict:
        if not self.lfs:
            return {"type": "file", "path": path, "size": len(self.data), "oid": git_blob_sha1(self.data)}
        sha256 = hashlib.sha256(self.data).hexdigest()
        pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {len(self.data)}\n".encode()
        return {
            "type": "file",
            "path": path,
            "size": len(self.data),
            "oid": git_blob_sha1(pointer),
            "lfs": {"oid": sha256, "size": len(self.data), "pointerSize": len(pointer)},
        }

    def preupload_oid(self) -> str:
        """What the Hub's preupload answers as ``oid``: sha256 for LFS files, the git oid otherwise."""
        return hashlib.sha256(self.data).hexdigest() if self.lfs else git_blob_sha1(self.data)


@dataclass
class Account:
    name: str
    orgs: dict[str, str] = field(default_factory=dict)  # org name -> role in org ("read", "write", "admin")
    token_role: str = "write"

    def can_write(self, namespace: str) -> bool:
        if self.token_role == "read":
            return False
        return namespace == self.name or self.orgs.get(namespace) in ("write", "admin")


@dataclass
class Repo:
    owner: str
    private: bool
    refs: dict[str, str] = field(default_factory=dict)  # branch or refs/pr/N -> commit oid
    snapshots: dict[str, dict[str, Blob]] = field(default_factory=dict)  # commit oid -> files
    prs: int = 0


@dataclass(frozen=True)
class Commit:
    repo_id: str
    ref: str
    oid: str
    summary: str
    paths: tuple[str, ...]


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, **extra: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.extra = status, message, code, extra


class HubDouble:
    """The server and its state. Use as a context manager; ``url`` is the endpoint to pass."""

    def __init__(self) -> None:
        self.accounts: dict[str, Account] = {}  # token -> account
        self.repos: dict[str, Repo] = {}
        self.lfs_store: dict[str, bytes] = {}
        self.commits: list[Commit] = []
        self.requests: list[tuple[str, str]] = []
        self.validated_yaml: list[str] = []
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> HubDouble:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def add_token(self, token: str, account: Account) -> None:
        self.accounts[token] = account

    def files(self, repo_id: str, ref: str = "main") -> dict[str, bytes]:
        repo = self.repos[repo_id]
        return {path: blob.data for path, blob in repo.snapshots[repo.refs[ref]].items()}

    # --- state changes (called with the lock held) ---------------------------------------------

    def _new_commit(self, repo: Repo, files: dict[str, Blob]) -> str:
        oid = hashlib.sha1(f"commit {next(self._ids)}".encode()).hexdigest()
        repo.snapshots[oid] = files
        return oid

    def _account(self, headers) -> Account:
        auth = headers.get("Authorization", "")
        account = self.accounts.get(auth.removeprefix("Bearer ").strip()) if auth.startswith("Bearer ") else None
        if account is None:
            raise HubError(401, "Invalid credentials in Authorization header")
        return account

    def _optional_account(self, headers) -> Account | None:
        return self.accounts.get(headers.get("Authorization", "").removeprefix("Bearer ").strip())

    def _repo(self, repo_id: str, account: Account | None) -> Repo:
        repo = self.repos.get(repo_id)
        if repo is None or (repo.private and (account is None or not account.can_write(repo.owner))):
            raise HubError(404, "Repository not found", "RepoNotFound")
        return repo

    def _head(self, repo: Repo, rev: str) -> str:
        if rev in repo.refs:
            return repo.refs[rev]
        if rev in repo.snapshots:
            return rev
        raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")

    def _write_access(self, account: Account, repo_id: str) -> None:
        if not account.can_write(repo_id.split("/")[0]):
            raise HubError(403, f"You don't have the rights to write to {repo_id}")

    # --- endpoints ---------------------------------------------------------------------------

    def handle(self, method: str, url: str, headers, body: bytes) -> tuple[int, dict | bytes, dict[str, str]]:
        parts = urlsplit(url)
        segments = [unquote(s) for s in parts.path.strip("/").split("/")]
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        self.requests.append((method, parts.path))
        with self._lock:
            if method == "GET" and segments == ["api", "whoami-v2"]:
                return 200, self.whoami(self._account(headers)), {}
            if method == "POST" and segments == ["api", "repos", "create"]:
                return 200, self.create_repo(self._account(headers), json.loads(body)), {}
            if method == "POST" and segments == ["api", "validate-yaml"]:
                return self.validate_yaml(json.loads(body)["content"])
            if method == "PUT" and segments[0] == "lfs-upload":
                return self.lfs_upload(segments[1], body)
            if method == "POST" and segments[-4:] == ["info", "lfs", "objects", "batch"]:
                repo_id = "/".join(segments[:-4]).removesuffix(".git")
                return 200, self.lfs_batch(self._account(headers), repo_id, json.loads(body)), {}
            if segments[:2] == ["api", "models"] and len(segments) >= 4:
                return self.repo_endpoint(method, "/".join(segments[2:4]), segments[4:], query, headers, body)
        raise HubError(404, f"The double does not serve {method} {parts.path}")

    def repo_endpoint(self, method, repo_id, rest, query, headers, body):
        if method == "GET" and (not rest or rest[0] == "revision"):
            repo = self._repo(repo_id, self._optional_account(headers))
            oid = self._head(repo, rest[1] if rest else "main")
            siblings = [{"rfilename": p} for p in sorted(repo.snapshots[oid])]
            return 200, {"id": repo_id, "sha": oid, "private": repo.private, "siblings": siblings}, {}
        if method == "GET" and rest[0] == "tree":
            repo = self._repo(repo_id, self._optional_account(headers))
            files = repo.snapshots[self._head(repo, rest[1])]
            prefix = "/".join(rest[2:])
            entries = [b.tree_entry(p) for p, b in sorted(files.items()) if p.startswith(prefix)]
            if query.get("recursive", "False").lower() != "true":
                entries = [e for e in entries if "/" not in e["path"][len(prefix) :].lstrip("/")]
            return 200, entries, {}
        account = self._account(headers)
        repo = self._repo(repo_id, account)
        if method == "POST" and rest[0] == "branch":
            self._write_access(account, repo_id)
            if rest[1] in repo.refs:
                raise HubError(409, f"Branch {rest[1]} already exists")
            repo.refs[rest[1]] = self._head(repo, json.loads(body or b"{}").get("startingPoint", "main"))
            return 200, {}, {}
        if method == "POST" and rest[0] == "preupload":
            self._write_access(account, repo_id)
            files = repo.snapshots[self._head(repo, rest[1])]
            answer = []
            for f in json.loads(body)["files"]:
                mode = "lfs" if f["path"].endswith(LFS_SUFFIXES) else "regular"
                entry = {"path": f["path"], "uploadMode": mode, "shouldIgnore": False}
                if f["path"] in files:
                    entry["oid"] = files[f["path"]].preupload_oid()
                answer.append(entry)
            return 200, {"files": answer, "commitOid": self._head(repo, rest[1])}, {}
        if method == "POST" and rest[0] == "commit":
            self._write_access(account, repo_id)
            return 200, self.commit(repo_id, repo, rest[1], query.get("create_pr") == "1", body), {}
        raise HubError(404, f"The double does not serve {method} /api/models/{repo_id}/{'/'.join(rest)}")

    def whoami(self, account: Account) -> dict:
        return {
            "type": "user",
            "name": account.name,
            "orgs": [{"type": "org", "name": org, "roleInOrg": role} for org, role in account.orgs.items()],
            "auth": {"type": "access_token", "accessToken": {"displayName": "test", "role": account.token_role}},
        }

    def create_repo(self, account: Account, payload: dict) -> dict:
        namespace = payload.get("organization") or account.name
        repo_id = f"{namespace}/{payload['name']}"
        self._write_access(account, repo_id)
        if repo_id in self.repos:
            raise HubError(409, "You already created this model repo", url=f"{self.url}/{repo_id}")
        repo = Repo(owner=namespace, private=payload.get("visibility") == "private")
        repo.refs["main"] = self._new_commit(repo, {".gitattributes": Blob(GITATTRIBUTES, lfs=False)})
        self.repos[repo_id] = repo
        return {"url": f"{self.url}/{repo_id}", "name": repo_id}

    def validate_yaml(self, content: str):
        self.validated_yaml.append(content)
        if not content.startswith("---\n"):
            return 200, {"errors": [], "warnings": [{"message": "empty or missing yaml metadata"}]}, {}
        try:
            metadata = yaml.safe_load(content.split("---\n")[1])
        except yaml.YAMLError as exc:
            return 400, {"errors": [{"message": f"invalid YAML: {exc}"}]}, {}
        if not isinstance(metadata, dict):
            return 400, {"errors": [{"message": "metadata must be a mapping"}]}, {}
        for entry in metadata.get("model-index") or []:
            for result in entry.get("results", []):
                if not {"task", "dataset", "metrics"} <= set(result):
                    return 400, {"errors": [{"message": "model-index results need task, dataset, metrics"}]}, {}
        return 200, {"errors": [], "warnings": []}, {}

    def lfs_batch(self, account: Account, repo_id: str, payload: dict) -> dict:
        self._repo(repo_id, account)
        self._write_access(account, repo_id)
        objects = []
        for obj in payload["objects"]:
            entry = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            if obj["oid"] not in self.lfs_store:
                entry["actions"] = {"upload": {"href": f"{self.url}/lfs-upload/{obj['oid']}", "header": {}}}
            objects.append(entry)
        return {"transfer": "basic", "objects": objects}

    def lfs_upload(self, oid: str, body: bytes):
        if hashlib.sha256(body).hexdigest() != oid:
            raise HubError(400, "sha256 of the uploaded content does not match the object id")
        self.lfs_store[oid] = body
        return 200, b"", {}

    def commit(self, repo_id: str, repo: Repo, rev: str, create_pr: bool, body: bytes) -> dict:
        parent = self._head(repo, rev)
        files = dict(repo.snapshots[parent])
        summary = ""
        paths = []
        for line in body.splitlines():
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                summary = value["summary"]
            elif key == "file":
                files[value["path"]] = Blob(base64.b64decode(value["content"]), lfs=False)
                paths.append(value["path"])
            elif key == "lfsFile":
                if value["oid"] not in self.lfs_store:
                    raise HubError(422, f"LFS object {value['oid']} was never uploaded")
                files[value["path"]] = Blob(self.lfs_store[value["oid"]], lfs=True)
                paths.append(value["path"])
            elif key == "deletedFile":
                files.pop(value["path"], None)
                paths.append(value["path"])
            else:
                raise HubError(400, f"unknown commit operation {key}")
        oid = self._new_commit(repo, files)
        answer = {"success": True, "commitOid": oid, "commitUrl": f"{self.url}/{repo_id}/commit/{oid}"}
        if create_pr:
            repo.prs += 1
            ref = f"refs/pr/{repo.prs}"
            answer["pullRequestUrl"] = f"{self.url}/{repo_id}/discussions/{repo.prs}"
        else:
            ref = rev
        repo.refs[ref] = oid
        self.commits.append(Commit(repo_id, ref, oid, summary, tuple(paths)))
        return answer


def _handler_for(hub: HubDouble) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while size := int(self.rfile.readline().strip() or b"0", 16):
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
                self.rfile.readline()
                return b"".join(chunks)
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _serve(self) -> None:
            body = self._body()
            try:
                status, payload, headers = hub.handle(self.command, self.path, self.headers, body)
            except HubError as err:
                status, payload = err.status, {"error": err.message, **err.extra}
                headers = {"X-Error-Message": err.message} | ({"X-Error-Code": err.code} if err.code else {})
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            self.send_response(status)
            kind = "application/octet-stream" if isinstance(payload, bytes) else "application/json"
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = _serve

        def log_message(self, format: str, *args: object) -> None:  # keep test output quiet
            pass

    return Handler
