"""The ``kind: GitSource`` manifest: a git repository deploykit follows itself (as Flux's GitRepository and
Kustomization, or Argo CD's Application, do), read with the same YAML reader as deployments so every error
says file:line:column:field. Credentials are named as files, never given inline. No git runs here.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..errors import Issue, ManifestError
from ..files import read_regular_file
from .schema import API_VERSION, Metadata
from .validation import validation_issues
from .values import Duration, Strict
from .yamlsource import load_documents

SOURCE_KIND = "GitSource"
MAX_SOURCE_BYTES = 64 << 10
MIN_INTERVAL, MAX_INTERVAL = 1.0, 86400.0  # a fetch a second at most; at least one a day
MIN_TIMEOUT, MAX_TIMEOUT = 1.0, 3600.0
_URL_RE = re.compile(r"^(https://|ssh://|git://|file://|/)\S+$")
_SHA_RE = re.compile(r"^[0-9a-f]{40}$|^[0-9a-f]{64}$")
_REF_RE = re.compile(r"^[A-Za-z0-9._/-]{1,200}$")
_SEMVER_TERM = re.compile(r"^(>=|<=|>|<|=)?v?(\d{1,9})(?:\.(\d{1,9}))?(?:\.(\d{1,9}))?$")


def _bounded(low: float, high: float) -> AfterValidator:
    def check(value: float) -> float:
        if not low <= value <= high:
            raise PydanticCustomError("bounds", f"must be between {low:g}s and {high:g}s")
        return value
    return AfterValidator(check)


def _url(value: str) -> str:
    if not _URL_RE.fullmatch(value):
        raise PydanticCustomError("url", "a repository is an https://, ssh://, git://, file:// URL or an absolute path")
    authority = value.split("/")[2] if "://" in value else ""
    userinfo = authority.rpartition("@")[0]
    if (value.startswith("https://") and userinfo) or ":" in userinfo:  # ssh://git@host: a user, no secret
        raise PydanticCustomError("url", "no credentials in the URL: name a token_file or an ssh_key_file")
    return value


def semver_terms(text: str) -> list[tuple[str, tuple[int, int, int]]]:
    """``'>=1.2 <2'`` as [(op, version)]; ValueError when a term is not one."""
    terms = []
    for raw in text.replace(",", " ").split():
        match = _SEMVER_TERM.fullmatch(raw)
        if match is None:
            raise ValueError(f"{raw!r} is no version comparison (e.g. '>=1.2.0 <2.0.0')")
        op, *parts = match.groups()
        terms.append((op or "=", (int(parts[0]), int(parts[1] or 0), int(parts[2] or 0))))
    if not terms:
        raise ValueError("an empty range")
    return terms


def _semver(value: str) -> str:
    try:
        semver_terms(value)
    except ValueError as exc:
        raise PydanticCustomError("semver", str(exc)) from None
    return value


def _ref_name(value: str) -> str:
    if not _REF_RE.fullmatch(value) or ".." in value or value.startswith(("-", "/")):
        raise PydanticCustomError("ref", "not a branch or tag name (letters, digits, '._/-')")
    return value


def _sha(value: str) -> str:
    if not _SHA_RE.fullmatch(value):
        raise PydanticCustomError("commit", "a commit is its full hexadecimal id (40 characters)")
    return value


def _repo_path(value: str) -> str:
    parts = Path(value).parts
    if value.startswith("/") or ".." in parts or len(value) > 500:
        raise PydanticCustomError("path", "a directory inside the repository, relative, without '..'")
    return str(PurePosixPath(value))  # "./hosts/a", "hosts//a/.": git's tree paths know no "." or "//"


class GitRef(Strict):
    """Which commit to follow: exactly one of a branch, a tag, a semver range of tags, or a commit."""

    branch: Annotated[str, AfterValidator(_ref_name)] | None = None
    tag: Annotated[str, AfterValidator(_ref_name)] | None = None
    semver: Annotated[str, AfterValidator(_semver)] | None = None
    commit: Annotated[str, AfterValidator(_sha)] | None = None

    @model_validator(mode="after")
    def _one(self) -> GitRef:
        given = [k for k in ("branch", "tag", "semver", "commit") if getattr(self, k) is not None]
        if len(given) != 1:
            raise PydanticCustomError("ref", "give exactly one of branch, tag, semver, commit (got {n})",
                                      {"n": len(given)})
        return self

    def describe(self) -> str:
        for key in ("branch", "tag", "semver", "commit"):
            if getattr(self, key) is not None:
                return f"{key} {getattr(self, key)}"
        return "?"


class Verify(Strict):
    """Apply only commits whose SSH signature a key in ``allowed_signers`` made (``git verify-commit``)."""

    mode: Literal["head"] = "head"
    allowed_signers: Path = Field(description="An ssh allowed_signers file (ssh-keygen(1)).")


class Webhook(Strict):
    """A push notification asks for a sync now: GitHub's X-Hub-Signature-256 or GitLab's X-Gitlab-Token,
    checked against the secret in ``secret_file``."""

    secret_file: Path


class GitSourceSpec(Strict):
    url: Annotated[str, AfterValidator(_url)] = Field(max_length=2000)
    ref: GitRef = Field(default_factory=lambda: GitRef(branch="main"))
    path: Annotated[str, AfterValidator(_repo_path)] = "."
    interval: Annotated[Duration, _bounded(MIN_INTERVAL, MAX_INTERVAL)] = 60.0
    timeout: Annotated[Duration, _bounded(MIN_TIMEOUT, MAX_TIMEOUT)] = 60.0
    prune: bool = False
    self_heal: bool = False
    ssh_key_file: Path | None = None
    known_hosts_file: Path | None = None
    token_file: Path | None = None
    ca_file: Path | None = Field(default=None, description="PEM certificates an https:// server's is checked "
                                 "against (a private CA); default: the system's.")
    verify: Verify | None = None
    webhook: Webhook | None = None

    @field_validator("ssh_key_file", "known_hosts_file", "token_file", "ca_file")
    @classmethod
    def _absolute(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_absolute():
            raise PydanticCustomError("path", "an absolute path")
        return value

    @model_validator(mode="after")
    def _credentials(self) -> GitSourceSpec:
        if (self.ssh_key_file is None) != (self.known_hosts_file is None):
            raise PydanticCustomError("credentials", "ssh_key_file and known_hosts_file go together",
                                      {"at": "ssh_key_file"})
        if self.token_file is not None and not self.url.startswith("https://"):
            raise PydanticCustomError("credentials", "token_file is for https:// repositories", {"at": "token_file"})
        if self.ca_file is not None and not self.url.startswith("https://"):
            raise PydanticCustomError("credentials", "ca_file is for https:// repositories", {"at": "ca_file"})
        if self.ssh_key_file is not None and not self.url.startswith("ssh://"):
            raise PydanticCustomError("credentials", "ssh_key_file is for ssh:// repositories", {"at": "ssh_key_file"})
        return self


class GitSource(Strict):
    api_version: Literal["deploykit/v1"] = Field(alias="apiVersion")
    kind: Literal["GitSource"]
    metadata: Metadata
    spec: GitSourceSpec

    @property
    def name(self) -> str:
        return self.metadata.name


def parse_source(data: bytes, *, source: str) -> GitSource:
    """The one GitSource document of ``data``; ManifestError with located issues otherwise."""
    documents, issues = load_documents(data, source)
    documents = [d for d in documents if d.data is not None]
    if not issues and len(documents) != 1:
        issues.append(Issue(f"a source file holds one GitSource document (found {len(documents)})", source, 1, 1))
    if issues:
        raise ManifestError(issues)
    doc = documents[0]
    if isinstance(doc.data, dict) and doc.data.get("kind") != SOURCE_KIND:
        line, column = doc.locate(("kind",))
        raise ManifestError([Issue(f"expected kind {SOURCE_KIND!r}, got {doc.data.get('kind')!r}", source, line,
                                   column, "kind")])
    try:
        return GitSource.model_validate(doc.data)
    except ValidationError as exc:
        issues = validation_issues(exc, doc, source)  # its hints name a deployment's fields: not these
        raise ManifestError([Issue(i.message, i.path, i.line, i.column, i.field) for i in issues]) from None


def load_source(path: str | Path) -> GitSource:
    """Read and validate a GitSource file (a regular file, at most 64 KiB)."""
    try:
        data = read_regular_file(path, MAX_SOURCE_BYTES)
    except OSError as exc:
        raise ManifestError.single(f"cannot read the source file: {exc.strerror or exc}", path=str(path)) from None
    return parse_source(data, source=str(path))


__all__ = ["API_VERSION", "GitRef", "GitSource", "GitSourceSpec", "Verify", "Webhook", "load_source",
           "parse_source", "semver_terms"]
