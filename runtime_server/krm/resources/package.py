"""A kpt package on disk: its Kptfile, its resources, its subpackages (docs/protocol.md, "Pipelines").

Resources are read with ruamel.yaml round-trip nodes and annotated with where they came from
(``internal.config.kubernetes.io/path`` and ``index``), so a render can write each one back into
its own file, in its place, with its comments and key order. The annotations never reach disk.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ruamel.yaml.comments import CommentedMap
from ruamel.yaml.error import CommentMark
from ruamel.yaml.tokens import CommentToken

from runtime_server.krm.resources.resourcelist import InvalidResourceList, kind, metadata, yaml

KPTFILE = "Kptfile"
PATH_ANNOTATION = "internal.config.kubernetes.io/path"
INDEX_ANNOTATION = "internal.config.kubernetes.io/index"
# A document's leading comment rides along as an annotation: as a ResourceList item, a mapping's
# start comment would be lost.
HEADER_ANNOTATION = "internal.fnkernel.dev/header-comment"
# How the file indents a sequence under its key, as kpt records it: "compact" (``key:\n- a``) or
# "wide" (``key:\n  - a``); the file is written back the same way.
SEQ_ANNOTATION = "internal.config.kubernetes.io/seqindent"
INTERNAL = (PATH_ANNOTATION, INDEX_ANNOTATION, HEADER_ANNOTATION, SEQ_ANNOTATION)
_SEQUENCE_UNDER_KEY = re.compile(
    r"^(?P<prefix>(?: |- )*)[^\s#-][^\n:]*:[ \t]*(?:#[^\n]*)?\n(?P<indent> *)- ", re.M
)
YAML_SUFFIXES = (".yaml", ".yml")


@dataclass
class Package:
    root: Path  # the package directory
    kptfile: CommentedMap
    resources: list[Any] = field(default_factory=list)  # this package's own, annotated
    texts: dict[str, str] = field(default_factory=dict)  # its files with resources, as read
    subpackages: list[Package] = field(default_factory=list)
    relative: str = ""  # from the top package, "" for itself

    @property
    def pipeline(self) -> dict[str, Any]:
        pipeline = self.kptfile.get("pipeline")
        return pipeline if isinstance(pipeline, dict) else {}

    def all_texts(self) -> dict[str, str]:
        """The text of every file with resources, its subpackages' included, by relative path."""
        texts = dict(self.texts)
        for sub in self.subpackages:
            texts.update(sub.all_texts())
        return texts

    def all_resources(self) -> list[Any]:
        """Its own resources and every subpackage's, depth first."""
        found = list(self.resources)
        for sub in self.subpackages:
            found += sub.all_resources()
        return found


def read_documents(text: str, source: str) -> list[Any]:
    try:
        documents = list(yaml().load_all(text))
    except Exception as exc:  # ruamel raises several unrelated types for bad input
        raise InvalidResourceList(f"{source}: not YAML: {exc}") from None
    return [doc for doc in documents if doc is not None]


def load_package(root: Path, relative: str = "", *, require_kptfile: bool = True) -> Package:
    """Read the package at `root` (it must hold a Kptfile, unless not `require_kptfile`) and
    its subpackages."""
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    kptfile_path = root / KPTFILE
    if kptfile_path.is_file():
        documents = read_documents(kptfile_path.read_text(), str(kptfile_path))
        kptfile = documents[0] if documents else CommentedMap()
    elif require_kptfile:
        raise FileNotFoundError(f"{root} is not a kpt package: it has no {KPTFILE}")
    else:
        kptfile = CommentedMap()
    package = Package(root, kptfile, relative=relative)
    _read_dir(package, root, relative)
    return package


class PackageError(Exception):
    """The package cannot be read: a symlink loop, a dangling symlink, an unreadable file. The
    message names the path; nothing has been written."""


def _check_symlink(path: Path, relative: str) -> None:
    """Symlinks inside a package are not followed, as kpt ignores them; one that is dangling or
    loops back into its own directory is an error, so that it is fixed rather than missed."""
    try:
        target = path.resolve(strict=True)
    except FileNotFoundError:
        raise PackageError(f"{relative}: dangling symlink to {os.readlink(path)}") from None
    except (OSError, RuntimeError):  # a loop of links: RuntimeError, or ELOOP from the kernel
        raise PackageError(f"{relative}: symlink loop") from None
    parent = path.parent.resolve()
    if target.is_dir() and (target == parent or target in parent.parents):
        raise PackageError(f"{relative}: symlink loop (it points to {target}, which holds it)")


def _read_dir(package: Package, directory: Path, relative: str) -> None:
    """Every YAML file below `directory` into `package`; a directory with a Kptfile is a
    subpackage, a hidden one is skipped, a symlink is not followed (``_check_symlink``)."""
    try:
        entries = sorted(directory.iterdir())
    except OSError as exc:
        raise PackageError(f"{relative or '.'}: cannot list: {exc.strerror}") from None
    for path in entries:
        if path.is_symlink():
            _check_symlink(path, f"{relative}{path.name}")
            continue
        if path.is_dir() and not path.name.startswith("."):
            if (path / KPTFILE).is_file():
                package.subpackages.append(load_package(path, f"{relative}{path.name}/"))
            else:
                _read_dir(package, path, f"{relative}{path.name}/")
        elif path.suffix in YAML_SUFFIXES:
            _read_file(package, path, f"{relative}{path.name}")


def sequence_style(text: str) -> str:
    match = _SEQUENCE_UNDER_KEY.search(text)
    if match and len(match.group("indent")) > len(match.group("prefix")):
        return "wide"
    return "compact"


def _read_file(package: Package, path: Path, relative: str) -> None:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise PackageError(f"{relative}: cannot read: {exc}") from None
    resources = read_resources(text, relative)
    if resources:
        package.texts[relative] = text
        package.resources += resources


def read_resources(text: str, relative: str) -> list[Any]:
    """The KRM objects of one file, annotated with where they came from."""
    documents = read_documents(text, relative)
    style = sequence_style(text)
    for index, document in enumerate(documents):
        if not isinstance(document, dict) or not kind(document):
            raise InvalidResourceList(f"{relative}: document {index} is not a KRM object")
        header = _take_header(document)
        annotations = metadata(document).setdefault("annotations", CommentedMap())
        annotations[PATH_ANNOTATION] = relative
        annotations[INDEX_ANNOTATION] = str(index)
        if header:
            annotations[HEADER_ANNOTATION] = header
        if style == "wide":
            annotations[SEQ_ANNOTATION] = style
    return documents


def _take_header(document: Any) -> str:
    comment = getattr(document, "ca", None) and document.ca.comment
    if not comment or len(comment) < 2 or not comment[1]:
        return ""
    document.ca.comment = None
    return "".join(token.value for token in comment[1] if token is not None)


def source_of(resource: Any) -> tuple[str, int]:
    notes = (resource.get("metadata") or {}).get("annotations") or {}
    return str(notes.get(PATH_ANNOTATION, "")), int(notes.get(INDEX_ANNOTATION, 0) or 0)


def strip_internal(resource: Any) -> Callable[[], None]:
    """Remove the internal annotations (and an annotations map left empty); returns a function
    that puts them back where they were."""
    meta = resource.get("metadata")
    notes = meta.get("annotations") if isinstance(meta, dict) else None
    if not isinstance(notes, dict):
        return lambda: None
    saved = [(key, notes.pop(key)) for key in INTERNAL if key in notes]
    position = None
    if not notes:
        position = list(meta).index("annotations")
        del meta["annotations"]
    header = dict(saved).get(HEADER_ANNOTATION)
    if header:
        resource.ca.comment = [None, [CommentToken(str(header), CommentMark(0), None)]]

    def restore() -> None:
        if position is not None:
            meta.insert(position, "annotations", notes)
        for key, value in saved:
            notes[key] = value
        if header:
            resource.ca.comment = None

    return restore


def default_path(resource: Any) -> str:
    meta = resource.get("metadata") or {}
    return f"{kind(resource).lower()}_{meta.get('name', 'unnamed')}.yaml"


def render_files(resources: list[Any]) -> dict[str, str]:
    """The package's files as they would be written: relative path → text, without the
    internal annotations. `resources` are left as they were."""
    by_file: dict[str, list[tuple[int, Any]]] = {}
    for position, resource in enumerate(resources):
        path, index = source_of(resource)
        by_file.setdefault(path or default_path(resource), []).append(
            (index if path else 10_000 + position, resource)
        )
    files = {}
    for path, entries in sorted(by_file.items()):
        documents = [resource for _, resource in sorted(entries, key=lambda entry: entry[0])]
        notes = (documents[0].get("metadata") or {}).get("annotations") or {}
        codec = yaml()
        if notes.get(SEQ_ANNOTATION) == "wide":
            codec.indent(mapping=2, sequence=4, offset=2)
        restores = [strip_internal(document) for document in documents]
        try:
            out = io.StringIO()
            codec.dump_all(documents, out)
            files[path] = out.getvalue()
        finally:
            for restore in restores:
                restore()
    return files
