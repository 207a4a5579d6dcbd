"""A protocol double of the Hugging Face Hub for the tests: NOT the Hub.

A small HTTP server on 127.0.0.1 that answers the endpoints ``huggingface_hub`` 2.4 (``HfApi``,
``hf_hub_download``, ``snapshot_download``, ``HfFileSystem``) and ``datasets`` 5.2 call, with the
payloads and headers their client code sends and reads (read from their source, not from the Hub).
It checks that featcal drives those clients correctly; it knows nothing of the Hub's own behaviour
beyond what the clients expect of it: not its rate limits, its CDN, Xet storage, nor how gated access
is granted.

Publishing, for models, datasets and spaces (``{type}`` is ``models``, ``datasets`` or ``spaces``):

- ``GET  /api/whoami-v2``                                   who the bearer token belongs to
- ``POST /api/repos/create``                                 409 when the repo exists, 403 outside your namespaces
- ``POST /api/{type}/{repo}/branch/{branch}``                create a branch (409 when it exists)
- ``POST /api/validate-yaml``                                README.md metadata check
- ``POST /api/{type}/{repo}/preupload/{rev}``                upload mode per file, remote oid when present
- ``POST /[{type}/]{repo}.git/info/lfs/objects/batch`` + ``PUT /lfs-upload/{oid}``   LFS basic transfer
- ``POST /api/{type}/{repo}/commit/{rev}``                   NDJSON commit (``?create_pr=1`` opens a PR)

Serving (downloads):

- ``GET  /api/{type}/{repo}[/revision/{rev}]``   repo info: head ``sha``, ``siblings`` (sizes and LFS with
  ``?blobs=true``), ``private``, ``gated``, ``cardData`` (the README's YAML header)
- ``GET  /api/{type}/{repo}/auth-check``          200, or the gate's 401/403 for an account not granted
- ``GET  /api/{type}/{repo}/tree/{rev}[/{path}]``  the files and folders under ``path``, ``?recursive=true``
  for all of them, ``?expand=true`` adds ``lastCommit``; sizes, git oids, LFS sha256
- ``POST /api/{type}/{repo}/paths-info/{rev}``    the same entries for the form fields ``paths``
- ``HEAD|GET /[{type}/]{repo}/resolve/{rev}/{path}``  a regular file: 200 with ``X-Repo-Commit``, ``ETag``
  (its git oid) and ``Content-Length``; an LFS file: 302 to the "CDN" (a second server on 127.0.0.1, so
  another origin, as the Hub's CDN is) with ``X-Linked-Etag`` (its sha256) and ``X-Linked-Size``.
  The CDN (``/cdn-lfs/{type}/{repo}/{sha256}``) and the resolve URLs answer ``Range`` requests (206).
- Refusals carry ``X-Error-Code`` as the Hub's do: ``RepoNotFound`` (404, also for a private repo the
  token cannot see), ``GatedRepo`` (401 without a token, 403 for an account not granted access; repo info
  and listings stay public, as on the Hub), ``EntryNotFound`` (404, with ``X-Repo-Commit``),
  ``RevisionNotFound``.

Faults, by rule (method, URL path pattern, how many times), checked before the request is answered:
:meth:`HubDouble.fail` answers a status instead (429 with the Hub's ``RateLimit`` headers, 503, ...);
:meth:`HubDouble.cut` sends a file's headers and part of its body, then closes the connection.

Large files go through LFS, as on the Hub; the double does not speak Xet, so tests turn Xet off
(``huggingface_hub.constants.HF_HUB_DISABLE_XET``, ``HF_HUB_DISABLE_XET=1``) and the client falls back
to LFS. Everything it receives is kept in memory for the tests to inspect; :attr:`HubDouble.served`
records each answer (method, path, status, body bytes sent).
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

import yaml

LFS_SUFFIXES = (".safetensors", ".png", ".bin", ".parquet", ".h5", ".msgpack")
GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.png filter=lfs diff=lfs merge=lfs -text\n"
REPO_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
URL_PREFIXES = {"model": "", "dataset": "datasets/", "space": "spaces/"}
COMMIT_DATE = "2024-01-01T00:00:00.000Z"


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass(frozen=True)
class Blob:
    data: bytes
    lfs: bool

    @staticmethod
    def of(path: str, data: bytes) -> Blob:
        """A file as the Hub stores it: in LFS when its suffix is tracked there."""
        return Blob(data, lfs=path.endswith(LFS_SUFFIXES))

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    def pointer(self) -> bytes:
        return f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {len(self.data)}\n".encode()

    def git_oid(self) -> str:
        """The git object id: of the LFS pointer for an LFS file, else of the content."""
        return git_blob_sha1(self.pointer() if self.lfs else self.data)

    def tree_entry(self, path: str) -> dict:
        entry = {"type": "file", "path": path, "size": len(self.data), "oid": self.git_oid()}
        if self.lfs:
            entry["lfs"] = {"oid": self.sha256, "size": len(self.data), "pointerSize": len(self.pointer())}
        return entry

    def preupload_oid(self) -> str:
        """What the Hub's preupload answers as ``oid``: sha256 for LFS files, the git oid otherwise."""
        return self.sha256 if self.lfs else git_blob_sha1(self.data)


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
    summaries: dict[str, str] = field(default_factory=dict)  # commit oid -> title
    prs: int = 0
    gated: bool = False
    granted: set[str] = field(default_factory=set)  # accounts given access to a gated repo


@dataclass(frozen=True)
class Commit:
    repo_id: str
    ref: str
    oid: str
    summary: str
    paths: tuple[str, ...]


@dataclass
class Fault:
    """An answer the double gives instead of the real one, ``times`` times, to requests matching it."""

    method: str  # "GET", "HEAD", ... or "*"
    pattern: str  # fnmatch pattern on the URL path (no query)
    times: int
    status: int | None = None  # answer this status ...
    keep: float | None = None  # ... or send this fraction of the body, then close the connection
    headers: dict[str, str] = field(default_factory=dict)
    message: str = ""
    hits: int = 0

    def matches(self, method: str, path: str) -> bool:
        return self.hits < self.times and self.method in ("*", method) and fnmatch.fnmatchcase(path, self.pattern)


@dataclass(frozen=True)
class Served:
    method: str
    path: str
    status: int
    sent: int  # body bytes written


class HubError(Exception):
    def __init__(
        self, status: int, message: str, code: str | None = None, headers: dict | None = None, **extra: str
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.extra = status, message, code, extra
        self.headers = headers or {}


class HubDouble:
    """The server and its state. Use as a context manager; ``url`` is the endpoint to pass."""

    def __init__(self) -> None:
        self.accounts: dict[str, Account] = {}  # token -> account
        self.repos: dict[str, Repo] = {}  # model repositories
        self.dataset_repos: dict[str, Repo] = {}
        self.space_repos: dict[str, Repo] = {}
        self.lfs_store: dict[str, bytes] = {}
        self.commits: list[Commit] = []
        self.requests: list[tuple[str, str]] = []
        self.served: list[Served] = []
        self.validated_yaml: list[str] = []
        self.faults: list[Fault] = []
        self._lock = threading.Lock()
        self._servers = [ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self)) for _ in range(2)]
        for server in self._servers:
            server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._servers[0].server_address[1]}"
        self.cdn_url = f"http://127.0.0.1:{self._servers[1].server_address[1]}"
        self._threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in self._servers]

    def __enter__(self) -> HubDouble:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()

    def add_token(self, token: str, account: Account) -> None:
        self.accounts[token] = account

    def store(self, repo_type: str = "model") -> dict[str, Repo]:
        return {"model": self.repos, "dataset": self.dataset_repos, "space": self.space_repos}[repo_type]

    def files(self, repo_id: str, ref: str = "main", repo_type: str = "model") -> dict[str, bytes]:
        repo = self.store(repo_type)[repo_id]
        return {path: blob.data for path, blob in repo.snapshots[repo.refs[ref]].items()}

    # --- what the tests set up ----------------------------------------------------------------

    def publish(
        self,
        repo_id: str,
        files: dict[str, bytes],
        *,
        repo_type: str = "model",
        summary: str = "Upload",
        private: bool = False,
        gated: bool = False,
        replace: bool = False,
    ) -> str:
        """Put ``files`` in ``repo_id`` as one commit on ``main`` (the repository is made if new); its oid.

        ``replace`` drops the files the repository held before (but ``.gitattributes``).
        """
        with self._lock:
            repo = self.store(repo_type).get(repo_id)
            if repo is None:
                repo = Repo(owner=repo_id.split("/")[0], private=private, gated=gated)
                self.store(repo_type)[repo_id] = repo
            parent: dict[str, Blob] = {".gitattributes": Blob(GITATTRIBUTES, lfs=False)}
            if "main" in repo.refs and not replace:
                parent = dict(repo.snapshots[repo.refs["main"]])
            blobs = {path: Blob.of(path, data) for path, data in files.items()}
            for blob in blobs.values():
                if blob.lfs:
                    self.lfs_store[blob.sha256] = blob.data
            head = repo.refs.get("main", "")
            repo.refs["main"] = self._new_commit(repo_id, repo, head, parent | blobs, summary)
            return repo.refs["main"]

    def publish_folder(self, repo_id: str, folder: str | Path, **kwargs) -> str:
        """:meth:`publish` every file under ``folder``, by its path relative to it."""
        folder = Path(folder)
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        return self.publish(repo_id, files, **kwargs)

    def fail(
        self,
        method: str,
        pattern: str,
        status: int,
        *,
        times: int = 1,
        headers: dict[str, str] | None = None,
        message: str | None = None,
    ) -> Fault:
        """Answer ``status`` to the next ``times`` requests matching ``method`` and the path ``pattern``.

        A 429 carries the Hub's rate-limit headers (``RateLimit: "api";r=0;t=0``) unless ``headers``
        says otherwise.
        """
        if status == 429 and headers is None:
            headers = {"RateLimit": '"api";r=0;t=0', "RateLimit-Policy": '"fixed window";"api";q=1000;w=300'}
        default = {429: "You have exceeded our hourly quotas", 503: "Service Unavailable"}.get(status, "Error")
        fault = Fault(method, pattern, times, status=status, headers=headers or {}, message=message or default)
        self.faults.append(fault)
        return fault

    def cut(self, pattern: str, *, times: int = 1, keep: float = 0.5) -> Fault:
        """Send the headers and the first ``keep`` of the body of the next ``times`` downloads matching
        ``pattern``, then close the connection (a download cut off mid-file)."""
        fault = Fault("GET", pattern, times, keep=keep)
        self.faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        self.faults.clear()

    def fault_for(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if fault.matches(method, path):
                    fault.hits += 1
                    return fault
        return None

    # --- state changes (called with the lock held) ---------------------------------------------

    def _new_commit(self, repo_id: str, repo: Repo, parent: str, files: dict[str, Blob], summary: str) -> str:
        """Record ``files`` as a commit; its oid derives from the repository, parent, summary and files."""
        listing = "".join(f"{path} {blob.git_oid()}\n" for path, blob in sorted(files.items()))
        oid = hashlib.sha1(f"{repo_id}\n{parent}\n{summary}\n{listing}".encode()).hexdigest()
        repo.snapshots[oid] = files
        repo.summaries[oid] = summary
        return oid

    def _account(self, headers) -> Account:
        auth = headers.get("Authorization", "")
        account = self.accounts.get(auth.removeprefix("Bearer ").strip()) if auth.startswith("Bearer ") else None
        if account is None:
            raise HubError(401, "Invalid credentials in Authorization header")
        return account

    def _optional_account(self, headers) -> Account | None:
        return self.accounts.get(headers.get("Authorization", "").removeprefix("Bearer ").strip())

    def _repo(self, repo_type: str, repo_id: str, account: Account | None) -> Repo:
        repo = self.store(repo_type).get(repo_id)
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

    def _check_gate(self, repo_type: str, repo_id: str, repo: Repo, account: Account | None) -> None:
        if not repo.gated or (account is not None and account.name in repo.granted):
            return
        kind = {"model": "model", "dataset": "dataset", "space": "space"}[repo_type]
        if account is None:
            raise HubError(
                401,
                f"Access to {kind} {repo_id} is restricted. You must have access to it and be authenticated "
                "to access it. Please log in.",
                "GatedRepo",
            )
        raise HubError(
            403,
            f"Access to {kind} {repo_id} is restricted and you are not in the authorized list. "
            f"Visit {self.url}/{URL_PREFIXES[repo_type]}{repo_id} to ask for access.",
            "GatedRepo",
        )

    # --- endpoints ---------------------------------------------------------------------------

    def handle(self, method: str, url: str, headers, body: bytes) -> tuple[int, dict | list | bytes, dict[str, str]]:
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
                repo_type, rest = _repo_type_prefix(segments[:-4])
                repo_id = "/".join(rest).removesuffix(".git")
                return 200, self.lfs_batch(self._account(headers), repo_type, repo_id, json.loads(body)), {}
            if segments[0] == "cdn-lfs" and method in ("GET", "HEAD"):
                return self.cdn(segments[-1], headers)
            if segments[0] == "api" and segments[1:2] and segments[1] in REPO_TYPES and len(segments) >= 4:
                repo_id = "/".join(segments[2:4])
                return self.repo_endpoint(method, REPO_TYPES[segments[1]], repo_id, segments[4:], query, headers, body)
            repo_type, rest = _repo_type_prefix(segments)
            if method in ("GET", "HEAD") and len(rest) >= 5 and rest[2] == "resolve":
                return self.resolve(repo_type, "/".join(rest[:2]), rest[3], "/".join(rest[4:]), headers)
        raise HubError(404, f"The double does not serve {method} {parts.path}")

    def repo_endpoint(self, method, repo_type, repo_id, rest, query, headers, body):
        if method == "GET" and rest == ["auth-check"]:  # huggingface_hub.auth_check: the gate, as files have it
            account = self._optional_account(headers)
            self._check_gate(repo_type, repo_id, self._repo(repo_type, repo_id, account), account)
            return 200, {}, {}
        if method == "GET" and (not rest or rest[0] == "revision"):
            repo = self._repo(repo_type, repo_id, self._optional_account(headers))
            oid = self._head(repo, rest[1] if rest else "main")
            return 200, self.repo_info(repo_type, repo_id, repo, oid, query.get("blobs", "").lower() == "true"), {}
        if method == "GET" and rest[0] == "tree":
            repo = self._repo(repo_type, repo_id, self._optional_account(headers))
            oid = self._head(repo, rest[1])
            prefix = "/".join(rest[2:]).strip("/")
            entries = self.tree(repo, oid, prefix, query.get("recursive", "false").lower() == "true")
            if entries is None:
                raise HubError(404, f"{prefix} does not exist on {rest[1]}", "EntryNotFound")
            if query.get("expand", "false").lower() == "true":
                entries = [self._expanded(repo, oid, e) for e in entries]
            return 200, entries, {}
        if method == "POST" and rest[0] == "paths-info":
            repo = self._repo(repo_type, repo_id, self._optional_account(headers))
            oid = self._head(repo, rest[1])
            form = parse_qs(body.decode())
            expand = form.get("expand", ["False"])[0].lower() == "true"
            entries = [e for p in form.get("paths", []) if (e := self.path_info(repo, oid, p.strip("/"))) is not None]
            return 200, [self._expanded(repo, oid, e) if expand else e for e in entries], {}
        account = self._account(headers)
        repo = self._repo(repo_type, repo_id, account)
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
        raise HubError(404, f"The double does not serve {method} /api/{repo_type}s/{repo_id}/{'/'.join(rest)}")

    # --- serving -------------------------------------------------------------------------------

    def repo_info(self, repo_type: str, repo_id: str, repo: Repo, oid: str, blobs: bool) -> dict:
        files = repo.snapshots[oid]
        siblings = []
        for path, blob in sorted(files.items()):
            sibling: dict = {"rfilename": path}
            if blobs:
                sibling |= {"size": len(blob.data), "blobId": blob.git_oid()}
                if blob.lfs:
                    sibling["lfs"] = {"sha256": blob.sha256, "size": len(blob.data), "pointerSize": len(blob.pointer())}
            siblings.append(sibling)
        info = {
            "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24],
            "id": repo_id,
            "author": repo.owner,
            "sha": oid,
            "lastModified": COMMIT_DATE,
            "createdAt": COMMIT_DATE,
            "private": repo.private,
            "gated": "auto" if repo.gated else False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": siblings,
        }
        card = _card_data(files.get("README.md"))
        if card is not None:
            info["cardData"] = card
        if repo_type == "space":
            info |= {"sdk": (card or {}).get("sdk", "gradio"), "runtime": {"stage": "BUILDING"}}
        return info

    def tree(self, repo: Repo, oid: str, prefix: str, recursive: bool) -> list[dict] | None:
        """The entries under ``prefix`` (None when it is no folder): files and folders, sorted by path."""
        files = repo.snapshots[oid]
        under = {p: b for p, b in files.items() if not prefix or p.startswith(prefix + "/")}
        if prefix and not under:
            return None
        entries: dict[str, dict] = {}
        for path, blob in under.items():
            rel = path[len(prefix) + 1 :] if prefix else path
            parts = rel.split("/")
            for depth in range(1, len(parts)):
                folder = "/".join(filter(None, [prefix, *parts[:depth]]))
                if recursive or depth == 1:
                    entries.setdefault(folder, self._folder_entry(files, folder))
            if recursive or len(parts) == 1:
                entries[path] = blob.tree_entry(path)
        return [entries[p] for p in sorted(entries)]

    def path_info(self, repo: Repo, oid: str, path: str) -> dict | None:
        files = repo.snapshots[oid]
        if path in files:
            return files[path].tree_entry(path)
        if any(p.startswith(path + "/") for p in files):
            return self._folder_entry(files, path)
        return None

    @staticmethod
    def _folder_entry(files: dict[str, Blob], folder: str) -> dict:
        content = "".join(f"{p}:{b.git_oid()}\n" for p, b in sorted(files.items()) if p.startswith(folder + "/"))
        return {"type": "directory", "path": folder, "oid": hashlib.sha1(content.encode()).hexdigest()}

    @staticmethod
    def _expanded(repo: Repo, oid: str, entry: dict) -> dict:
        """``entry`` with ``lastCommit`` (the double reports the head commit for every path)."""
        return entry | {"lastCommit": {"id": oid, "title": repo.summaries.get(oid, ""), "date": COMMIT_DATE}}

    def resolve(self, repo_type: str, repo_id: str, rev: str, path: str, headers):
        account = self._optional_account(headers)
        repo = self._repo(repo_type, repo_id, account)
        oid = self._head(repo, rev)
        self._check_gate(repo_type, repo_id, repo, account)
        blob = repo.snapshots[oid].get(path)
        if blob is None:
            raise HubError(404, "Entry not found", "EntryNotFound", headers={"X-Repo-Commit": oid})
        commit = {"X-Repo-Commit": oid}
        if blob.lfs:
            location = f"{self.cdn_url}/cdn-lfs/{repo_type}s/{repo_id}/{blob.sha256}?filename={quote(path)}"
            return (
                302,
                b"",
                commit
                | {
                    "Location": location,
                    "ETag": f'"{blob.git_oid()}"',
                    "X-Linked-Etag": f'"{blob.sha256}"',
                    "X-Linked-Size": str(len(blob.data)),
                },
            )
        return _ranged(blob.data, headers, commit | {"ETag": f'"{blob.git_oid()}"'})

    def cdn(self, sha256: str, headers):
        data = self.lfs_store.get(sha256)
        if data is None:
            raise HubError(404, "NoSuchKey")
        return _ranged(data, headers, {"ETag": f'"{sha256}"'})

    # --- publishing ------------------------------------------------------------------------------

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
        repo_type = payload.get("type") or "model"
        url = f"{self.url}/{URL_PREFIXES[repo_type]}{repo_id}"
        self._write_access(account, repo_id)
        if repo_id in self.store(repo_type):
            raise HubError(409, f"You already created this {repo_type} repo", url=url)
        repo = Repo(owner=namespace, private=payload.get("visibility") == "private" or bool(payload.get("private")))
        files = {".gitattributes": Blob(GITATTRIBUTES, lfs=False)}
        repo.refs["main"] = self._new_commit(repo_id, repo, "", files, "initial commit")
        self.store(repo_type)[repo_id] = repo
        return {"url": url, "name": repo_id}

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

    def lfs_batch(self, account: Account, repo_type: str, repo_id: str, payload: dict) -> dict:
        self._repo(repo_type, repo_id, account)
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
        oid = self._new_commit(repo_id, repo, parent, files, summary)
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


def _repo_type_prefix(segments: list[str]) -> tuple[str, list[str]]:
    """The repository type a URL path names by its first segment (``datasets/``, ``spaces/``), and the rest."""
    if segments and segments[0] in ("datasets", "spaces"):
        return REPO_TYPES[segments[0]], segments[1:]
    return "model", segments


def _card_data(readme: Blob | None) -> dict | None:
    if readme is None or not readme.data.startswith(b"---\n"):
        return None
    try:
        data = yaml.safe_load(readme.data.decode().split("---\n")[1])
    except (yaml.YAMLError, UnicodeDecodeError, IndexError):
        return None
    return data if isinstance(data, dict) else None


RANGE = re.compile(r"bytes=(\d*)-(\d*)$")


def _ranged(data: bytes, headers, extra: dict[str, str]):
    """The whole of ``data`` (200), or the part a ``Range: bytes=a-b`` header asks for (206)."""
    match = RANGE.match(headers.get("Range", "").strip())
    size = len(data)
    if not match or not (match[1] or match[2]):
        return 200, data, extra
    if match[1]:
        start, end = int(match[1]), min(int(match[2]) if match[2] else size - 1, size - 1)
    else:  # a suffix: the last N bytes
        start, end = max(size - int(match[2]), 0), size - 1
    if start >= size or start > end:
        raise HubError(416, "Requested Range Not Satisfiable", headers={"Content-Range": f"bytes */{size}"})
    return 206, data[start : end + 1], extra | {"Content-Range": f"bytes {start}-{end}/{size}"}


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
            path = urlsplit(self.path).path
            fault = hub.fault_for(self.command, path)
            try:
                if fault is not None and fault.status is not None:
                    raise HubError(fault.status, fault.message, headers=fault.headers)
                status, payload, headers = hub.handle(self.command, self.path, self.headers, body)
            except HubError as err:
                status, payload = err.status, {"error": err.message, **err.extra}
                headers = {"X-Error-Message": err.message} | ({"X-Error-Code": err.code} if err.code else {})
                headers |= err.headers
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            self.send_response(status)
            kind = "application/octet-stream" if isinstance(payload, bytes) else "application/json"
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()
            if self.command == "HEAD":
                data = b""
            elif fault is not None and fault.keep is not None and status in (200, 206) and data:
                data = data[: int(len(data) * fault.keep)]
                self.close_connection = True
            self.wfile.write(data)
            self.wfile.flush()
            hub.served.append(Served(self.command, path, status, len(data)))

        do_GET = do_POST = do_PUT = do_HEAD = _serve

        def log_message(self, format: str, *args: object) -> None:  # keep test output quiet
            pass

    return Handler


def isolate_from_the_real_hub(monkeypatch, tmp_path) -> None:
    """For a test against the double: no token from the environment or a stored login, online (the
    test conftest sets HF_HUB_OFFLINE), and LFS instead of Xet, which the double does not speak."""
    import huggingface_hub.constants

    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-login" / "token"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
