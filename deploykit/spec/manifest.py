"""A manifest file turned into validated manifests, and what can be checked about them on this host.

A manifest is the single source of truth for a deployment. This module reads a file into validated,
immutable ``LoadedManifest`` values (the schema is ``deploykit.spec.schema``'s), or raises a
``ManifestError`` that lists *every* problem with its file, line, column, field path and, where one
helps, a hint (located by ``deploykit.spec.validation``). It also decides which files of a directory are
manifests, checks a manifest against this host without reading weights, and gives the JSON Schema. It
must never import torch or transformers: ``deploykit validate`` stays fast because of that.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..errors import ApplyError, Issue, ManifestError
from ..names import Task
from .adapters import AdapterFileError, base_weight_shapes, fit_problem, read_adapter
from .engines import LLAMA_CPP
from .speculative import draft_checkpoint_problem
from .schema import ModelDeployment
from .tensor_parallel import heads_issues
from .validation import header_issues, validation_issues
from .yamlsource import MAX_BYTES, Document, load_documents


@dataclass(frozen=True)
class LoadedManifest:
    """A validated manifest with where it came from, so later errors can point into the file."""

    manifest: ModelDeployment
    source: str  # the file as the user named it
    base_dir: Path  # relative paths in the manifest resolve against this
    document: Document
    commit: str | None = None  # the git commit it came from, when known apart from its file (a recorded revision)

    @property
    def name(self) -> str:
        return self.manifest.metadata.name

    def resolve(self, path: Path) -> Path:
        return path if path.is_absolute() else (self.base_dir / path)

    @property
    def model_path(self) -> Path:
        return self.resolve(self.manifest.spec.model.path)

    @property
    def digest(self) -> str:
        """What the manifest asks for, independent of comments, formatting and how paths are written."""
        import hashlib

        return "sha256:" + hashlib.sha256(self.text.encode()).hexdigest()

    @cached_property
    def text(self) -> str:
        """This manifest as YAML, for the record of a revision (re-applied by rollback); computed once.
        Aliases are written out in full, so the text is bounded by the reader's expanded-size limit, and
        refused when it outgrows what a manifest file may be (it is read back by rollback and restore)."""
        import yaml

        data = self.manifest.model_dump(mode="json", by_alias=True)
        for section, key in (("model", "path"), ("sharding", "path")):
            value = data["spec"][section].get(key)
            if value is not None:
                data["spec"][section][key] = str(self.resolve(Path(value)).resolve())
        disk = data["spec"]["offload"].get("disk")
        if disk:
            disk["path"] = str(self.resolve(Path(disk["path"])).resolve())
        engine = data["spec"].get("engine")
        if engine and engine.get("binary"):
            engine["binary"] = str(self.resolve(Path(engine["binary"])).resolve())
        for adapter in data["spec"].get("adapters", []):
            adapter["path"] = str(self.resolve(Path(adapter["path"])).resolve())
        draft = (data["spec"].get("speculative") or {}).get("draft")
        if draft and draft.get("path"):
            draft["path"] = str(self.resolve(Path(draft["path"])).resolve())
        gates = data["spec"]["rollout"].get("gates")
        if gates and gates.get("golden"):
            gates["golden"] = str(self.resolve(Path(gates["golden"])).resolve())
        text = yaml.safe_dump(data, sort_keys=False)
        if len(text.encode()) > MAX_BYTES:
            raise ManifestError([Issue(f"the manifest, its aliases written out, is {len(text.encode())} bytes; a "
                                       f"manifest may be at most {MAX_BYTES} bytes", self.source, self.document.line,
                                       1, hint="write shorter values, or fewer of them")])
        return text

    def locate(self, field: str) -> tuple[int, int]:
        parts: tuple[str | int, ...] = tuple(int(p) if p.isdigit() else p for p in field.split("."))
        return self.document.locate(parts)

    def located(self, field: str | None, message: str) -> str:
        """``message`` as ``FILE:LINE:COL: field: message``, or ``FILE: error: message`` without a field."""
        if field is None:
            return f"{self.source}: error: {message}"
        line, column = self.locate(field)
        return f"{self.source}:{line}:{column}: {field}: {message}"

    def issue(self, field: str, message: str, hint: str | None = None) -> Issue:
        line, column = self.locate(field)
        return Issue(message, self.source, line, column, field, hint)


def parse_manifests(data: bytes, *, source: str, base_dir: Path) -> list[LoadedManifest]:
    """Validate every document in ``data``. Raises ManifestError listing all issues of the file."""
    documents, issues = load_documents(data, source)
    documents = [d for d in documents if d.data is not None]
    read_spots = {(i.line, i.column) for i in issues}  # a value the reader refused (a number): said once
    loaded: list[LoadedManifest] = []
    names: dict[str, int] = {}
    for doc in documents:
        header = header_issues(doc, source)
        if header:
            issues.extend(header)
            continue
        try:
            manifest = ModelDeployment.model_validate(doc.data)
        except ValidationError as exc:
            issues.extend(i for i in validation_issues(exc, doc, source) if (i.line, i.column) not in read_spots)
            continue
        if manifest.metadata.name in names:
            line, column = doc.locate(("metadata", "name"))
            issues.append(Issue(f"name {manifest.metadata.name!r} is already used by the manifest at "
                                f"line {names[manifest.metadata.name]}", source, line, column,
                                "metadata.name"))
            continue
        names[manifest.metadata.name] = doc.line
        loaded.append(LoadedManifest(manifest, source, base_dir, doc))
    if issues:
        issues.sort(key=lambda i: (i.line or 0, i.column or 0))
        raise ManifestError(issues)
    return loaded


MANIFEST_SUFFIXES = (".yaml", ".yml")


def manifest_files(path: Path) -> list[Path]:
    """The manifest files ``path`` stands for: itself, or a directory's ``*.yaml``/``*.yml`` files in
    name order (not recursive). The one place that decides which files are manifests."""
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.suffix in MANIFEST_SUFFIXES and p.is_file())
    return [path]


def load_manifests(path: str | Path) -> list[LoadedManifest]:
    """Read and validate a manifest file. Raises ManifestError (also for an unreadable file)."""
    source = str(path)
    file = Path(path)
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        raise ManifestError.single("no such file", path=source) from None
    except IsADirectoryError:
        raise ManifestError.single("is a directory; give a manifest file", path=source) from None
    except OSError as exc:
        raise ManifestError.single(f"cannot read the file: {exc.strerror}", path=source) from None
    return parse_manifests(data, source=source, base_dir=file.resolve().parent)


def manifest_named(path: Path, name: str | None) -> LoadedManifest:
    """The manifest named ``name`` in the file at ``path``; without a name, the file's only one (an
    ``ApplyError`` when it holds none of that name, or several)."""
    manifests = load_manifests(path)
    if name is not None:
        chosen = [m for m in manifests if m.name == name]
        if not chosen:
            raise ApplyError(f"{path}: no manifest named {name!r}")
        return chosen[0]
    if len(manifests) != 1:
        raise ApplyError(f"{path} holds {len(manifests)} manifests; pass name=")
    return manifests[0]


def check_on_host(loaded: LoadedManifest) -> list[Issue]:
    """What can be checked about a manifest on this machine without reading weights."""
    issues: list[Issue] = []
    model_dir = loaded.model_path
    if model_dir.is_file():  # a GGUF file (llama.cpp, Ollama); its magic is checked, not its name
        try:
            with open(model_dir, "rb") as fh:
                magic = fh.read(4)
        except OSError as exc:
            magic, reason = b"", f": {exc.strerror}"
        else:
            reason = ""
        if magic != b"GGUF":
            issues.append(loaded.issue("spec.model.path", f"{str(model_dir)!r} is a file but not a GGUF file "
                                       f"(it does not start with the bytes 'GGUF'){reason}",
                                       hint="point path at a Hugging Face checkpoint directory or a .gguf file"))
    elif loaded.manifest.spec.engine.name == LLAMA_CPP:
        issues.append(loaded.issue("spec.model.path", f"the llama.cpp engine serves a GGUF file; {str(model_dir)!r} "
                                   "is not one" + (" (a directory)" if model_dir.is_dir() else " (no such file)"),
                                   hint="point path at a .gguf file (the first file of a split set), or use "
                                        "engine.name: transformers for a checkpoint directory"))
    elif not model_dir.is_dir():
        kind = "GGUF file" if model_dir.suffix == ".gguf" else "model directory"
        issues.append(loaded.issue("spec.model.path", f"{kind} {str(model_dir)!r} does not exist"))
    elif not (model_dir / "config.json").is_file():
        issues.append(loaded.issue("spec.model.path", f"{str(model_dir)!r} holds no config.json",
                                   hint="point path at a Hugging Face checkpoint directory or a .gguf file"))
    if not issues:
        issues.extend(heads_issues(loaded))
        issues.extend(adapter_issues(loaded))
        issues.extend(draft_issues(loaded))
    issues.extend(_golden_issues(loaded))
    issues.extend(_scale_out_issues(loaded))
    disk = loaded.manifest.spec.offload.disk
    if disk is not None:
        disk_dir = loaded.resolve(disk.path)
        if disk_dir.exists() and not disk_dir.is_dir():
            issues.append(loaded.issue("spec.offload.disk.path", f"{str(disk_dir)!r} is not a directory"))
    return issues


def adapter_issues(loaded: LoadedManifest) -> list[Issue]:
    """Each adapter that is missing, not a PEFT LoRA directory, or does not fit the base checkpoint (its
    target modules and shapes against the base's safetensors headers), at ``spec.adapters.<i>.path``."""
    adapters = loaded.manifest.spec.adapters
    if not adapters:
        return []
    issues: list[Issue] = []
    try:
        base = base_weight_shapes(loaded.model_path)
    except AdapterFileError as exc:
        return [loaded.issue("spec.model.path", str(exc))]
    for i, adapter in enumerate(adapters):
        directory = loaded.resolve(adapter.path)
        try:
            problem = fit_problem(read_adapter(directory), base)
        except AdapterFileError as exc:
            problem = str(exc)
        else:
            problem = problem and f"adapter {adapter.name!r} ({directory}): {problem}"
        if problem:
            issues.append(loaded.issue(f"spec.adapters.{i}.path", problem,
                                       hint="a directory saved by peft's save_pretrained for this base model"))
    return issues


def draft_issues(loaded: LoadedManifest) -> list[Issue]:
    """A draft checkpoint (``spec.speculative.draft.path``, transformers engine) that is missing, not a
    checkpoint, or does not share the model's vocabulary, tokenizer and chat template."""
    speculative = loaded.manifest.spec.speculative
    draft = speculative.draft if speculative is not None else None
    if draft is None or draft.path is None or loaded.manifest.spec.engine.name == LLAMA_CPP:
        return []
    problem = draft_checkpoint_problem(loaded.model_path, loaded.resolve(draft.path))
    if problem is None:
        return []
    return [loaded.issue("spec.speculative.draft.path", problem,
                         hint="a smaller checkpoint of the same family, saved with the model's tokenizer files")]


def golden_path(loaded: LoadedManifest) -> Path | None:
    """The golden file of the manifest's gates, resolved against the manifest, if it names one."""
    gates = loaded.manifest.spec.rollout.gates
    return loaded.resolve(gates.golden) if gates is not None and gates.golden is not None else None


def _golden_issues(loaded: LoadedManifest) -> list[Issue]:
    """A golden file that is missing, empty or not JSON lines, at ``spec.rollout.gates.golden``."""
    from .golden import GoldenError, read_golden

    path = golden_path(loaded)
    if path is None:
        return []
    try:
        read_golden(path)
    except GoldenError as exc:
        return [loaded.issue("spec.rollout.gates.golden", str(exc),
                             hint='one JSON object per line: {"prompt": "..."} or {"messages": [...]}, and '
                                  '"completion"; `deploykit golden NAME --prompts FILE` records them')]
    return []


def _scale_out_issues(loaded: LoadedManifest) -> list[Issue]:
    """What a deployment on a Ray cluster cannot serve. Planning does not need these (a plan against
    ``--devices`` needs no cluster); deploying does."""
    spec, issues = loaded.manifest.spec, []
    if spec.placement.nodes > 1 and spec.cluster is None:
        issues.append(loaded.issue("spec.placement.nodes", f"{spec.placement.nodes} nodes need a cluster: add "
                                   "spec.cluster.address (a Ray address, 'auto' or 'local'), or set nodes to 1"))
    if spec.replicas > 1 and spec.cluster is None:
        issues.append(loaded.issue("spec.replicas", f"{spec.replicas} replicas need a cluster: add "
                                   "spec.cluster.address (a Ray address, 'auto' or 'local'), or set replicas to 1"))
    if spec.cluster is not None and spec.model.task != Task.CAUSAL_LM:
        issues.append(loaded.issue("spec.model.task", f"a cluster (replicas, pipeline stages) serves causal-lm "
                                   f"models only, not {spec.model.task}", hint="remove spec.cluster"))
    return issues


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a manifest, for editors (yaml-language-server) and CI."""
    schema = ModelDeployment.model_json_schema(by_alias=True, mode="validation")
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = "https://deploykit.dev/schema/deploykit-v1.json"
    return schema
