"""The KRM function wire format: a ``config.kubernetes.io/v1`` ResourceList (docs/protocol.md, "FunctionEvaluator").

Items are ruamel.yaml round-trip nodes, so a function that edits them keeps comments, key order and
quoting of everything it did not touch. ``results`` are the structured results every function may
add (severity error, warning or info).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import YAMLError
from ruamel.yaml.tokens import CommentToken

API_VERSION = "config.kubernetes.io/v1"
KIND = "ResourceList"
LOCAL_CONFIG = "config.kubernetes.io/local-config"
ERROR, WARNING, INFO = "error", "warning", "info"


class FunctionFailure(Exception):
    """Raised by a builtin function that fails without an error result, as a catalog function
    does by returning false (set-labels without a config, say)."""


class InvalidResourceList(ValueError):
    """The bytes are not a ResourceList (not YAML, or not the right shape)."""


def yaml() -> YAML:
    """A round-trip YAML codec with the layout kpt writes: 2-space maps, indented sequences."""
    codec = YAML(typ="rt")
    codec.preserve_quotes = True
    codec.width = 4096  # never fold a long string
    codec.representer.add_representer(type(None), _null)  # `key: null`, as Go writes it
    return codec


def _null(representer: Any, _: None) -> Any:
    return representer.represent_scalar("tag:yaml.org,2002:null", "null")


def yaml_problem(exc: BaseException) -> str:
    """A YAML parser's error in one line: its problem and where (line and column from 1)."""
    problem, mark = getattr(exc, "problem", None), getattr(exc, "problem_mark", None)
    if problem and mark is not None:
        return f"{problem} (line {mark.line + 1}, column {mark.column + 1})"
    return " ".join(str(exc).split())


def load(data: bytes | str) -> Any:
    try:
        return yaml().load(data)
    except YAMLError as exc:
        raise InvalidResourceList(f"not YAML: {yaml_problem(exc)}") from None


def deep_copy(node: Any) -> Any:
    """A deep copy of a ruamel.yaml node, comments included."""
    return load(dump(node))


def dump(value: Any) -> bytes:
    out = io.StringIO()
    yaml().dump(value, out)
    return out.getvalue().encode()


@dataclass
class Result:
    """One structured result (kpt ``results[]``)."""

    message: str
    severity: str = INFO
    resource: dict[str, str] | None = None
    field_path: str = ""
    file_path: str = ""
    tags: dict[str, str] = field(default_factory=dict)
    file_index: int = 0

    def to_yaml(self) -> CommentedMap:
        node = CommentedMap(message=self.message)
        if self.severity:  # a catalog function may leave it out
            node["severity"] = self.severity
        if self.resource:
            node["resourceRef"] = CommentedMap(self.resource)
        if self.field_path:
            node["field"] = CommentedMap(path=self.field_path)
        if self.file_path:
            node["file"] = CommentedMap(path=self.file_path)
            if self.file_index:
                node["file"]["index"] = self.file_index
        if self.tags:
            node["tags"] = CommentedMap(self.tags)
        return node


class ResourceList:
    """A parsed ResourceList: ``items``, ``function_config`` and ``results``."""

    def __init__(self, document: dict[str, Any]) -> None:
        self.document = document
        self.stderr: list[str] = []  # what a builtin function prints on its stderr

    @classmethod
    def parse(cls, data: bytes | str) -> ResourceList:
        document = load(data)
        if document is None:
            document = CommentedMap(apiVersion=API_VERSION, kind=KIND)
        if not isinstance(document, dict):
            raise InvalidResourceList("a ResourceList must be a YAML mapping")
        if _checked_items(document) is None:
            document["items"] = CommentedSeq()
        return cls(document)

    @classmethod
    def of(
        cls, items: list[Any], function_config: Any = None, results: list[Any] | None = None
    ) -> ResourceList:
        document = CommentedMap(apiVersion=API_VERSION, kind=KIND, items=CommentedSeq(items))
        if function_config is not None:
            document["functionConfig"] = function_config
        if results:
            document["results"] = CommentedSeq(results)
        return cls(document)

    @property
    def items(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.document["items"]
        return items

    @property
    def function_config(self) -> dict[str, Any] | None:
        config = self.document.get("functionConfig")
        return config if isinstance(config, dict) and config else None

    @property
    def results(self) -> list[Any]:
        results = self.document.get("results")
        return list(results) if isinstance(results, list) else []

    def add_results(self, results: list[Result]) -> None:
        if not results:
            return
        existing = self.document.get("results")
        if not isinstance(existing, list):
            existing = self.document["results"] = CommentedSeq()
        existing.extend(result.to_yaml() for result in results)

    def has_errors(self) -> bool:
        return any(isinstance(r, dict) and r.get("severity") == ERROR for r in self.results)

    def to_bytes(self) -> bytes:
        return dump(self.document)

    def apply(self, output: Any) -> None:
        """Make this ResourceList the one a KRM function returned as JSON (`output`), changing
        only what differs (``update_in_place``: the rest keeps its comments and style).
        InvalidResourceList, saying why, unless `output` is one: an object whose ``items`` are
        KRM objects, or one of kind ResourceList without them (every resource removed). An
        apiVersion or kind it leaves out stays as it was."""
        if not isinstance(output, dict):
            raise InvalidResourceList(f"got {_JSON_KINDS.get(type(output), 'a number')}")
        items = _checked_items(output)
        if items is None and "kind" not in output:
            keys = ", ".join(map(str, list(output)[:5]))
            raise InvalidResourceList(f"it has no items (its keys: {keys or 'none'})")
        api_version = self.document.get("apiVersion", API_VERSION)
        update_in_place(
            self.document, {"apiVersion": api_version, "kind": KIND, **output, "items": items or []}
        )


_JSON_KINDS = {list: "a list", str: "a string", bool: "a boolean", type(None): "null"}


def _checked_items(document: Mapping[str, Any]) -> list[Any] | None:
    """The items of a ResourceList's `document` (None if it has none), as ``parse`` takes
    input and ``apply`` a function's output: InvalidResourceList if it is of another kind, or
    its items are not a list of KRM objects."""
    if document.get("kind", KIND) != KIND:
        raise InvalidResourceList(f"kind must be {KIND}, got {document.get('kind')!r}")
    items = document.get("items")
    if items is not None and not (
        isinstance(items, list) and all(isinstance(item, dict) for item in items)
    ):
        raise InvalidResourceList("items must be a list of KRM objects")
    return items


# Comments keep their absolute column through ruamel.yaml, so a resource that travels through a
# ResourceList (one level deeper, and with internal annotations that lengthen flow-style lines)
# would come back with its end-of-line comments moved. Record each comment's column before, and
# put it back after: an untouched resource is then written back byte for byte.
CommentKey = tuple[tuple[Any, ...], Any, int, str]


def _comment_tokens(node: Any, path: tuple[Any, ...]) -> Iterator[tuple[CommentKey, CommentToken]]:
    attribute = getattr(node, "ca", None)
    if attribute is not None:
        slots: list[tuple[Any, Any]] = [("", attribute.comment)]
        slots += list(attribute.items.items())
        for key, entry in slots:
            for position, token in _flatten(entry):
                yield (path, key, position, token.value), token
    if isinstance(node, dict):
        for key, child in node.items():
            yield from _comment_tokens(child, (*path, key))
    elif isinstance(node, list):
        for index, child in enumerate(node):
            yield from _comment_tokens(child, (*path, index))


def _flatten(entry: Any, base: int = 0) -> Iterator[tuple[int, CommentToken]]:
    if isinstance(entry, CommentToken):
        if entry.start_mark is not None:
            yield base, entry
    elif isinstance(entry, list):
        for position, part in enumerate(entry):
            yield from _flatten(part, base * 16 + position + 1)


def comment_columns(node: Any) -> dict[CommentKey, int]:
    """Where each comment inside `node` sits, keyed by its place and text."""
    return {key: token.column for key, token in _comment_tokens(node, ())}


def restore_comment_columns(node: Any, columns: Mapping[CommentKey, int]) -> None:
    """Put back the columns `comment_columns` recorded, for the comments still in place."""
    for key, token in _comment_tokens(node, ()):
        if key in columns:
            token.column = columns[key]


def _commented(node: Any) -> Iterator[Any]:
    """Every container node below `node` (itself included) that holds a comment."""
    attribute = getattr(node, "ca", None)
    if attribute is not None and (attribute.comment or attribute.items or attribute.end):
        yield node
    children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
    for child in children:
        if isinstance(child, dict | list):
            yield from _commented(child)


def keep_comments(items: list[Any]) -> Callable[[], None]:
    """Record the comments of `items`; the function returned puts back those a function then
    removed from nodes it kept (kpt restores what a function drops: docs/krm.md, "Comments")."""
    saved = [
        (node, node.ca.comment, dict(node.ca.items), list(node.ca.end or []))
        for item in items
        for node in _commented(item)
    ]

    def restore() -> None:
        for node, comment, entries, end in saved:
            _put_back(node, comment, entries, end)

    return restore


def copy_missing_comments(old: Any, new: Any) -> None:
    """Give `new` (a function's output of `old`) each comment of `old` it lacks, field by field
    and element by element, as kpt does for what a function drops."""
    attribute = getattr(old, "ca", None)
    if attribute is not None and getattr(new, "ca", None) is not None:
        _put_back(new, attribute.comment, attribute.items, list(attribute.end or []))
    if isinstance(old, dict) and isinstance(new, dict):
        for key, child in old.items():
            if key in new and isinstance(child, dict | list):
                copy_missing_comments(child, new[key])
    elif isinstance(old, list) and isinstance(new, list):
        for child, other in zip(old, new, strict=False):
            if isinstance(child, dict | list):
                copy_missing_comments(child, other)


def _put_back(node: Any, comment: Any, entries: Mapping[Any, Any], end: list[Any]) -> None:
    """Give `node` each of these comments its own place lacks."""
    ca = node.ca
    if ca.comment is None and comment:
        ca.comment = comment
    for key, entry in entries.items():
        present = (
            key in node if isinstance(node, dict) else isinstance(key, int) and key < len(node)
        )
        if present and key not in ca.items:
            ca.items[key] = entry
    if end and not ca.end:
        ca.end = end


def format_result(result: Mapping[str, Any]) -> str:
    """A result as kpt prints it: ``[severity] apiVersion/kind/namespace/name field: message``,
    each part only when present (severity defaults to info)."""
    ref = result.get("resourceRef") or {}
    line = f"[{result.get('severity') or INFO}]"
    where = "/".join(
        str(ref[key]) for key in ("apiVersion", "kind", "namespace", "name") if ref.get(key)
    )
    field = (result.get("field") or {}).get("path", "")
    for part in (where, field):
        if part:
            line += f" {part}"
    return f"{line}: {result.get('message', '')}"


def update_in_place(node: Any, value: Any, made: Callable[[Any], Any] | None = None) -> Any:
    """Make the ruamel.yaml `node` equal to the JSON `value`, changing only what differs, so
    the comments and the flow or block style of everything unchanged survive a JSON round trip.
    Returns the node to use (a new one when the types differ). `made` turns a new value into
    its node (default: block_style)."""
    made = made or block_style
    if isinstance(node, dict) and isinstance(value, dict):
        for key in [k for k in node if k not in value]:
            del node[key]
        for key, new in value.items():
            node[key] = update_in_place(node[key], new, made) if key in node else made(new)
        return node
    if isinstance(node, list) and isinstance(value, list) and len(node) == len(value):
        for index, new in enumerate(value):
            node[index] = update_in_place(node[index], new, made)
        return node
    if isinstance(node, list) and isinstance(value, list):
        # Elements were added or removed: keep each surviving object's node (found by its
        # identity, or by position in a list of anonymous elements), so that it keeps its
        # comments and style.
        old = {identity(element): element for element in node if identity(element)}
        if not old:
            kept = [update_in_place(n, v, made) for n, v in zip(node, value, strict=False)]
            node[:] = kept + [made(new) for new in value[len(kept) :]]
            return node
        node[:] = [
            update_in_place(old[key], new, made) if (key := identity(new)) in old else made(new)
            for new in value
        ]
        return node
    if isinstance(node, dict | list) or isinstance(value, dict | list) or node != value:
        return made(value)
    return node


def identity(value: Any) -> tuple[str, ...] | None:
    """What names a KRM object in a list: where it came from if known, else its kind and name."""
    if not isinstance(value, dict) or not isinstance(value.get("metadata"), dict):
        return None
    meta = value["metadata"]
    notes = meta.get("annotations") if isinstance(meta.get("annotations"), dict) else {}
    where = tuple(
        str(notes.get(k, ""))
        for k in (
            "internal.config.kubernetes.io/package-path",
            "internal.config.kubernetes.io/path",
            "internal.config.kubernetes.io/index",
        )
    )
    if any(where):
        return where
    return (
        str(value.get("apiVersion")),
        str(value.get("kind")),
        str(meta.get("namespace")),
        str(meta.get("name")),
    )


def block_style(value: Any) -> Any:
    """JSON values as ruamel.yaml nodes written in block style (as a resource file is)."""
    if isinstance(value, dict):
        return CommentedMap((str(k), block_style(v)) for k, v in value.items())
    if isinstance(value, list):
        return CommentedSeq(block_style(v) for v in value)
    return value


# Helpers over one KRM object (a mapping)


def api_group(obj: dict[str, Any]) -> str:
    api_version = str(obj.get("apiVersion", ""))
    return api_version.rpartition("/")[0] if "/" in api_version else ""


def kind(obj: dict[str, Any]) -> str:
    return str(obj.get("kind", ""))


def metadata(obj: dict[str, Any]) -> dict[str, Any]:
    """The object's metadata mapping, created if missing."""
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        meta = obj["metadata"] = CommentedMap()
    return meta


def annotations_of(obj: dict[str, Any]) -> dict[str, Any]:
    meta = obj.get("metadata")
    found = meta.get("annotations") if isinstance(meta, dict) else None
    return found if isinstance(found, dict) else {}


def is_local_config(obj: dict[str, Any]) -> bool:
    return str(annotations_of(obj).get(LOCAL_CONFIG, "false")).lower() == "true"


def walk(node: Any, path: list[str], *, create: bool) -> Iterator[dict[str, Any]]:
    """The mappings at `path` below `node` (kustomize fieldSpec style: a list on the way is
    entered element by element; ``name[]`` marks a list explicitly). With `create`, missing
    mappings are created, never lists."""
    if not path:
        if isinstance(node, dict):
            yield node
        return
    if isinstance(node, list):
        for element in node:
            yield from walk(element, path, create=create)
        return
    if not isinstance(node, dict):
        return
    key = path[0].removesuffix("[]")
    child = node.get(key)
    if child is None:
        if not create or path[0].endswith("[]"):
            return
        child = node[key] = CommentedMap()
    yield from walk(child, path[1:], create=create)
