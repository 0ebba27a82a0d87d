"""A kpt package on disk: its Kptfile, its resources, its subpackages (docs/protocol.md, "Pipelines").

Resources are read with ruamel.yaml round-trip nodes and annotated with where they came from
(``internal.config.kubernetes.io/path`` and ``index``), so a render can write each one back into
its own file, in its place, with its comments and key order. The annotations never reach disk.
"""

from __future__ import annotations

import fnmatch
import io
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import CommentMark
from ruamel.yaml.scalarstring import SingleQuotedScalarString
from ruamel.yaml.tokens import CommentToken

from fnkernel.runtime_server.krm.resources import kptfile
from fnkernel.runtime_server.krm.resources.resourcelist import (
    InvalidResourceList,
    deep_copy,
    kind,
    metadata,
    yaml,
    yaml_problem,
)

KPTFILE = "Kptfile"
# Where each resource came from, as kpt annotates what it reads, in kpt's order: the legacy
# names (functions written for older kpt read these) and the internal ones.
LEGACY_INDEX_ANNOTATION = "config.kubernetes.io/index"
LEGACY_PATH_ANNOTATION = "config.kubernetes.io/path"
INDEX_ANNOTATION = "internal.config.kubernetes.io/index"
PATH_ANNOTATION = "internal.config.kubernetes.io/path"
# Which package a resource belongs to, while a parent package's function has it (kpt's name):
# its path is then relative to that package (docs/krm.md, "Where resources are written").
PACKAGE_PATH_ANNOTATION = "internal.config.kubernetes.io/package-path"
# How the file indents a sequence under its key, as kpt records it: "compact" (``key:\n- a``) or
# "wide" (``key:\n  - a``); the file is written back the same way.
SEQ_ANNOTATION = "internal.config.kubernetes.io/seqindent"
# A document's leading comment rides along as an annotation: as a ResourceList item, a mapping's
# start comment would be lost.
HEADER_ANNOTATION = "internal.fnkernel.dev/header-comment"
INTERNAL = (
    LEGACY_INDEX_ANNOTATION,
    LEGACY_PATH_ANNOTATION,
    INDEX_ANNOTATION,
    PATH_ANNOTATION,
    PACKAGE_PATH_ANNOTATION,
    SEQ_ANNOTATION,
    HEADER_ANNOTATION,
)
_SEQUENCE_UNDER_KEY = re.compile(
    r"^(?P<prefix>(?: |- )*)[^\s#-][^\n:]*:[ \t]*(?:#[^\n]*)?\n(?P<indent> *)- ", re.M
)
YAML_SUFFIXES = (".yaml", ".yml")


@dataclass
class Package:
    root: Path  # the package directory
    kptfile: CommentedMap  # as read; its resource form (annotated, a copy) is `kptfile_resource`
    resources: list[Any] = field(default_factory=list)  # this package's own, annotated
    texts: dict[str, str] = field(default_factory=dict)  # its files with resources, as read
    subpackages: list[Package] = field(default_factory=list)
    relative: str = ""  # from the top package, "" for itself
    kptfile_resource: Any = None
    not_krm: list[str] = field(default_factory=list)  # "PATH: why", for documents kpt refuses

    @property
    def pipeline(self) -> dict[str, Any]:
        pipeline = self.kptfile.get("pipeline")
        return pipeline if isinstance(pipeline, dict) else {}

    @property
    def display(self) -> str:
        """How kpt names the package in messages: "." for the top, "./sub" below it."""
        return f"./{self.relative.rstrip('/')}" if self.relative else "."

    def local_resources(self) -> list[Any]:
        """Its own resources and, as kpt gives them to functions, its Kptfile last."""
        meta = [self.kptfile_resource] if self.kptfile_resource is not None else []
        return [*self.resources, *meta]

    def all_texts(self) -> dict[str, str]:
        """The text of every file with resources, its subpackages' included, by relative path."""
        texts = dict(self.texts)
        for sub in self.subpackages:
            texts.update(sub.all_texts())
        return texts

    def all_resources(self, *, meta: bool = False) -> list[Any]:
        """Its own resources and every subpackage's, depth first; with `meta`, the Kptfiles too."""
        found = self.local_resources() if meta else list(self.resources)
        for sub in self.subpackages:
            found += sub.all_resources(meta=meta)
        return found

    def all_not_krm(self) -> list[str]:
        found = list(self.not_krm)
        for sub in self.subpackages:
            found += sub.all_not_krm()
        return found


def read_documents(text: str, source: str) -> list[Any]:
    try:
        documents = list(yaml().load_all(text))
    except Exception as exc:  # ruamel raises several unrelated types for bad input
        raise InvalidResourceList(f"{source}: not YAML: {yaml_problem(exc)}") from None
    return [doc for doc in documents if doc is not None]


# ruamel.yaml's words for a problem → Go's YAML reader's, which kpt prints.
_GO_YAML_WORDS = {
    "mapping values are not allowed here": "mapping values are not allowed in this context"
}


def _yaml_error(exc: Exception) -> str:
    """A YAML parse error as Go's reader words it: ``yaml: line N: problem``."""
    mark = getattr(exc, "context_mark", None) or getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    problem = _GO_YAML_WORDS.get(problem, problem)
    return f"yaml: line {mark.line + 1}: {problem}" if mark is not None else f"yaml: {problem}"


def read_kptfile(root: Path, display: str) -> tuple[CommentedMap, str]:
    """The package's Kptfile (and its text), checked as kpt checks it (kptfile.check,
    validate_function)."""
    path = root / KPTFILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise PackageError(f'No Kptfile found at "{display}".') from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PackageError(f'Kptfile at "{display}" can\'t be read: {exc}') from None
    try:
        documents = [doc for doc in yaml().load_all(text) if doc is not None]
    except Exception as exc:  # ruamel raises several unrelated types for bad input
        reason = _yaml_error(exc)
        raise PackageError(
            f'Kptfile at "{display}" can\'t be read.\n\nDetails:\n{reason}',
            kptfile_of=display,
            reason=reason,
        ) from None
    document = documents[0] if documents else CommentedMap()
    try:
        kptfile.check(document)
        pipeline = document.get("pipeline") or {}
        for stage in ("mutators", "validators"):
            for index, spec in enumerate(pipeline.get(stage) or []):
                kptfile.validate_function(spec, f"pipeline.{stage}[{index}]")
    except kptfile.KptfileError as exc:
        why = str(exc)
        prefix = "" if why.startswith("Kptfile is invalid") else f'Kptfile at "{display}" '
        reason = why.partition("Details:\n")[2] or why
        raise PackageError(prefix + why, kptfile_of=display, reason=reason) from None
    return document, text


def load_package(root: Path, relative: str = "", *, require_kptfile: bool = True) -> Package:
    """Read the package at `root` (it must hold a Kptfile, unless not `require_kptfile`) and
    its subpackages. Files the package's ``.krmignore`` names are passed over."""
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    display = f"./{relative.rstrip('/')}" if relative else str(root)
    package = Package(root, CommentedMap(), relative=relative)
    if (root / KPTFILE).is_file() or require_kptfile:
        package.kptfile, text = read_kptfile(root, display)
        package.kptfile_resource = deep_copy(package.kptfile)
        _annotate(package.kptfile_resource, f"{relative}{KPTFILE}", 0, sequence_style(text))
        package.texts[f"{relative}{KPTFILE}"] = text
    _check_config_files(package)
    _read_dir(package, root, relative, _ignore_patterns(root))
    return package


def _config_paths(package: Package) -> list[tuple[str, str, dict[str, Any]]]:
    """(field, configPath, step) of each pipeline step that names a config file."""
    found = []
    for stage in ("mutators", "validators"):
        for index, spec in enumerate(package.pipeline.get(stage) or []):
            if isinstance(spec, dict) and spec.get("configPath"):
                found.append((f"pipeline.{stage}[{index}]", str(spec["configPath"]), spec))
    return found


def _check_config_files(package: Package) -> None:
    """A configPath names a file of the package holding exactly one KRM object."""
    for field_name, path, _ in _config_paths(package):

        def refuse(reason: str, field_name: str = field_name, path: str = path) -> PackageError:
            return PackageError(kptfile.invalid(f"{field_name}.configPath", path, reason))

        try:
            text = (package.root / path).read_text()
        except OSError as exc:
            where = f"{package.root.name}/{path}"
            raise refuse(
                f"failed to open functionConfig from path {kptfile.go_quote(path)}: "
                f"open {where}: {(exc.strerror or str(exc)).lower()}"
            ) from None
        try:
            documents = read_documents(text, path)
        except InvalidResourceList as exc:
            raise refuse(f"failed to read functionConfig {kptfile.go_quote(path)}: {exc}") from None
        if len(documents) > 1:
            raise refuse(
                f"functionConfig {kptfile.go_quote(path)} must not contain more than one config, "
                f"got {len(documents)}"
            )
        why = not_krm(documents[0] if documents else None, path)
        if why:
            raise refuse(f"functionConfig {kptfile.go_quote(path)}: {why}")


def check_config_paths(package: Package) -> None:
    """A configPath names one of the package's own resources (not a subpackage's); kpt checks
    it as the package's pipeline starts."""
    own = {source_of(resource)[0] for resource in package.resources}
    for field_name, path, spec in _config_paths(package):
        if f"{package.relative}{os.path.normpath(path)}" not in own:
            step = "validator" if field_name.startswith("pipeline.validators") else "mutator"
            name = str(spec.get("name") or "") or _image_name(str(spec.get("image") or ""))
            raise PackageError(
                kptfile.invalid(
                    f"{field_name}.configPath",
                    path,
                    f"functionConfig resource for {step} {kptfile.go_quote(name)} is missing from "
                    f"path {kptfile.go_quote(path)}, this also occurs if "
                    f"{kptfile.go_quote(path)} is part of a subpackage",
                )
            )


def _image_name(image: str) -> str:
    """An image's base name, without registry, tag or digest."""
    name = image.partition("@")[0].rpartition("/")[2]
    return name.partition(":")[0]


def _ignore_patterns(root: Path) -> list[str]:
    """The package's ``.krmignore``: one gitignore-style pattern a line."""
    path = root / ".krmignore"
    if not path.is_file():
        return []
    lines = (line.strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def _ignored(relative: str, patterns: list[str]) -> bool:
    """Whether a path (relative to the package, "/"-separated) matches a .krmignore pattern: one
    with a "/" inside is matched against the whole path, others against each name in it."""
    names = relative.split("/")
    for pattern in patterns:
        pattern = pattern.rstrip("/")
        if "/" in pattern:
            if fnmatch.fnmatchcase(relative, pattern.lstrip("/")):
                return True
        elif any(fnmatch.fnmatchcase(name, pattern) for name in names):
            return True
    return False


class PackageError(Exception):
    """The package cannot be read: a symlink loop, a dangling symlink, an unreadable file, an
    invalid Kptfile. The message names the path; nothing has been written. For a Kptfile that
    cannot be read, `kptfile_of` is its package ("./db") and `reason` kpt's words for why."""

    def __init__(self, message: str, *, kptfile_of: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.kptfile_of = kptfile_of
        self.reason = reason


def _check_symlink(path: Path, relative: str) -> None:
    """Symlinks inside a package are not followed, as kpt ignores them (one back to the package
    or above it included); one that is dangling or a loop of links is an error, so that it is
    fixed rather than missed."""
    try:
        path.resolve(strict=True)
    except FileNotFoundError:
        raise PackageError(f"{relative}: dangling symlink to {os.readlink(path)}") from None
    except (OSError, RuntimeError):  # a loop of links: RuntimeError, or ELOOP from the kernel
        raise PackageError(f"{relative}: symlink loop") from None


def _read_dir(package: Package, directory: Path, relative: str, ignore: list[str]) -> None:
    """Every YAML file below `directory` into `package`; a directory with a Kptfile is a
    subpackage, a hidden one is skipped, a symlink is not followed (``_check_symlink``)."""
    try:
        entries = sorted(directory.iterdir())
    except OSError as exc:
        raise PackageError(f"{relative or '.'}: cannot list: {exc.strerror}") from None
    inside = relative.removeprefix(package.relative)  # the path .krmignore patterns see
    for path in entries:
        if _ignored(f"{inside}{path.name}", ignore):
            continue
        if path.is_symlink():
            _check_symlink(path, f"{relative}{path.name}")
            continue
        if path.is_dir() and not path.name.startswith("."):
            if (path / KPTFILE).is_file():
                package.subpackages.append(load_package(path, f"{relative}{path.name}/"))
            else:
                _read_dir(package, path, f"{relative}{path.name}/", ignore)
        elif path.suffix in YAML_SUFFIXES or path.name in KUSTOMIZATION_FILES[2:]:
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
    resources = read_resources(text, relative, refused=package.not_krm)
    if resources:
        package.texts[relative] = text
        package.resources += resources


KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")


def not_krm(document: Any, relative: str) -> str:
    """Why kpt would not pass `document` to a function ("" if it would): a KRM object needs
    ``apiVersion``, ``kind`` and ``metadata.name``; a kustomization is let through."""
    if not isinstance(document, dict):
        return "resource must have `apiVersion`, `kind`, and `name`"
    api_version, kind_ = str(document.get("apiVersion") or ""), str(document.get("kind") or "")
    if relative.rpartition("/")[2] in KUSTOMIZATION_FILES:
        return ""
    if api_version.startswith("kustomize.config.k8s.io") or (
        not api_version and kind_ == "Kustomization"
    ):
        return ""
    meta = document.get("metadata")
    if not api_version:
        return "resource must have `apiVersion`"
    if not kind_:
        return "resource must have `kind`"
    if not isinstance(meta, dict) or not meta.get("name"):
        return "resource must have `metadata.name`"
    return ""


def read_resources(text: str, relative: str, *, refused: list[str] | None = None) -> list[Any]:
    """The objects of one file, annotated with where they came from. A document that is not a
    KRM object is an error, or, given `refused`, noted there ("PATH: why") and kept."""
    documents = read_documents(text, relative)
    style = sequence_style(text)
    for index, document in enumerate(documents):
        why = not_krm(document, relative)
        if why and (refused is None or not isinstance(document, dict)):
            raise InvalidResourceList(f"{relative}: document {index} is not a KRM object: {why}")
        if why:
            refused.append(f"{relative}: {why}")  # type: ignore[union-attr]
        _annotate(document, relative, index, style)
    return documents


def _annotate(document: Any, relative: str, index: int, style: str) -> None:
    header = _take_header(document)
    annotations = metadata(document).setdefault("annotations", CommentedMap())
    for key in INTERNAL:  # a file that came with them (a ResourceList written by kpt) loses them
        annotations.pop(key, None)
    annotations[LEGACY_INDEX_ANNOTATION] = str(index)
    annotations[LEGACY_PATH_ANNOTATION] = relative
    annotations[INDEX_ANNOTATION] = str(index)
    annotations[PATH_ANNOTATION] = relative
    annotations[SEQ_ANNOTATION] = style
    if header:
        annotations[HEADER_ANNOTATION] = header


def _take_header(document: Any) -> str:
    """The comment before a node's first entry, taken off it."""
    comment = getattr(document, "ca", None) and document.ca.comment
    if not comment or len(comment) < 2 or not comment[1]:
        return ""
    document.ca.comment = None
    return "".join(token.value for token in comment[1] if token is not None)


def source_of(resource: Any) -> tuple[str, int]:
    notes = (resource.get("metadata") or {}).get("annotations") or {}
    return str(notes.get(PATH_ANNOTATION, "")), int(notes.get(INDEX_ANNOTATION, 0) or 0)


def strip_internal(resource: Any, *, tidy: bool = False) -> Callable[[], None]:
    """Remove the internal annotations (and an annotations map left empty, and a metadata map
    left empty: a document without metadata, a kustomization say); returns a function that puts
    them back where they were. `tidy`: drop the blank lines in and after the leading comment,
    as kpt's writer does (docs/krm.md, "Writing files")."""
    meta = resource.get("metadata")
    notes = meta.get("annotations") if isinstance(meta, dict) else None
    if not isinstance(notes, dict):
        return lambda: None
    # each with its place, so that restoring keeps the order a function added keys in (kpt
    # prints the annotations a function set after the ones the package was read with)
    places = sorted((list(notes).index(key), key) for key in INTERNAL if key in notes)
    saved = [(place, key, notes.pop(key)) for place, key in places]
    position = meta_position = None
    if not notes:
        position = list(meta).index("annotations")
        del meta["annotations"]
        if not meta:
            meta_position = list(resource).index("metadata")
            del resource["metadata"]
    header = next((value for _, key, value in saved if key == HEADER_ANNOTATION), None)
    if header:
        text = str(header)
        if tidy:
            text = "".join(line for line in text.splitlines(keepends=True) if line.strip())
        resource.ca.comment = [None, [CommentToken(text, CommentMark(0), None)]]

    def restore() -> None:
        if meta_position is not None:
            resource.insert(meta_position, "metadata", meta)
        if position is not None:
            meta.insert(position, "annotations", notes)
        for place, key, value in saved:
            if isinstance(notes, CommentedMap):
                notes.insert(place, key, value)
            else:
                notes[key] = value
        if header:
            resource.ca.comment = None

    return restore


def default_path(resource: Any) -> str:
    """Where kpt writes a resource that says no file: ``[NAMESPACE/]KIND_NAME.yaml``."""
    meta = resource.get("metadata") or {}
    name = f"{kind(resource).lower()}_{meta.get('name', 'unnamed')}.yaml"
    namespace = meta.get("namespace")
    return f"{namespace}/{name}" if namespace else name


def unwrapped(resources: list[Any]) -> str:
    """The resources as one YAML stream, without the annotations that say where they came from
    (``kpt fn eval -o unwrap``)."""
    documents = []
    for resource in resources:
        style = _seq_style(resource)
        restore = strip_internal(resource, tidy=True)
        try:
            documents.append(dump_text(resource, style))
        finally:
            restore()
    return "---\n".join(documents)


def resource_list_items(text: str) -> list[Any]:
    """The items of a ResourceList as kpt prints one (``fn source``, ``-o stdout``), each with
    the comment written before it or after its dash kept as its leading comment."""
    from fnkernel.runtime_server.krm.resources.resourcelist import ResourceList

    document = ResourceList.parse(text).document
    items = document["items"]
    # A comment before an item's dash is its document's, as if a blank line followed it in a
    # file (resource_list_text writes it back there); the first item's hangs on the list itself.
    comments = [_take_header(items)]
    for previous in list(items)[:-1]:
        comments.append(_take_trailing_comment(previous))
    comments = [comment + "\n" if comment else "" for comment in comments]
    for position in range(len(items)):  # ``- # …``: the object's own comment, after the dash
        slot = items.ca.items.pop(position, None)
        if slot and len(slot) > 1 and slot[1]:
            comments[position] = "".join(token.value for token in slot[1] if token is not None)
    for item, comment in zip(items, comments, strict=True):
        if comment:
            metadata(item).setdefault("annotations", CommentedMap())[HEADER_ANNOTATION] = comment
    return list(items)


def _take_trailing_comment(node: Any) -> str:
    """The whole-line comments after the last value of `node` (ruamel hangs the comment that
    precedes the next list item there), taken off it."""
    while True:
        if isinstance(node, dict) and node:
            key: Any = list(node)[-1]
        elif isinstance(node, list) and node:
            key = len(node) - 1
        else:
            return ""
        child = node[key]
        if isinstance(child, dict | list) and child:
            node = child
            continue
        slot = node.ca.items.get(key) if hasattr(node, "ca") else None
        position = 2 if isinstance(node, dict) else 0
        token = slot[position] if slot and len(slot) > position else None
        if token is None or "\n#" not in token.value:
            return ""
        end_of_line, _, rest = token.value.partition("\n")
        token.value = end_of_line + "\n" if end_of_line.strip() else "\n"
        return "".join(line + "\n" for line in rest.splitlines() if line.startswith("#"))


def resource_list_text(resources: list[Any]) -> str:
    """The resources as the ResourceList kpt prints (``-o stdout``, ``fn source``): each keeps
    the annotations that say where it came from, quoted as kpt quotes them, and its leading
    comment comes before it."""
    document = CommentedMap(apiVersion="config.kubernetes.io/v1", kind="ResourceList")
    document["items"] = CommentedSeq()
    if not resources:
        return dump_text(document, "compact")
    texts = [dump_text(document, "compact").removesuffix(" []\n") + "\n"]
    for resource in resources:
        item = deep_copy(resource)
        notes = metadata(item).get("annotations") or {}
        header = str(notes.pop(HEADER_ANNOTATION, "") or "")
        if "annotations" in metadata(item) and not notes:
            del metadata(item)["annotations"]
        for key in INTERNAL:
            if key in notes:
                notes[key] = SingleQuotedScalarString(str(notes[key]))
        text = dump_text(CommentedSeq([item]), "compact")
        if header.endswith("\n\n"):
            # a comment set off by a blank line is the document's: it comes before the item
            text = header.rstrip("\n") + "\n" + text
        elif header:
            # one that touches the first key is the object's: after the dash, as kpt writes it
            text = "- " + "\n  ".join(header.rstrip("\n").splitlines()) + "\n  " + text[2:]
        texts.append(text)
    return "".join(texts)


def render_files(resources: list[Any], *, tidy: bool = False) -> dict[str, str]:
    """The package's files as they would be written: relative path → text, without the
    internal annotations. `resources` are left as they were. `tidy`: see strip_internal."""
    by_file: dict[str, list[tuple[int, Any]]] = {}
    for position, resource in enumerate(resources):
        path, index = source_of(resource)
        by_file.setdefault(path or default_path(resource), []).append(
            (index if path else 10_000 + position, resource)
        )
    files = {}
    for path, entries in sorted(by_file.items()):
        documents = [resource for _, resource in sorted(entries, key=lambda entry: entry[0])]
        style = _seq_style(documents[0])
        restores = [strip_internal(document, tidy=tidy) for document in documents]
        try:
            files[path] = dump_text(documents, style, many=True)
        finally:
            for restore in restores:
                restore()
    return files


def _seq_style(resource: Any) -> str:
    notes = (resource.get("metadata") or {}).get("annotations") or {}
    return str(notes.get(SEQ_ANNOTATION, "compact"))


def dump_text(value: Any, style: str, *, many: bool = False) -> str:
    """YAML text with sequences indented under their key or not (``style`` wide / compact)."""
    codec = yaml()
    if style == "wide":
        codec.indent(mapping=2, sequence=4, offset=2)
    out = io.StringIO()
    if many:
        codec.dump_all(value, out)
    else:
        codec.dump(value, out)
    return out.getvalue()
