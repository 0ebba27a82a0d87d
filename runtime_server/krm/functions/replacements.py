"""``apply-replacements``: kustomize replacements as a KRM function (written from kustomize's
documented schema and behaviour).

functionConfig: ``fn.kpt.dev/v1alpha1 ApplyReplacements`` with ``replacements: [{source |
sourceValue, targets}]``. The source selects exactly one resource (group, version, kind, name,
namespace) and reads ``fieldPath`` (default ``metadata.name``), optionally one part of it
(``options.delimiter`` / ``index``). Each target selects resources (plus label and annotation
selectors), minus ``reject``, and writes each of its ``fieldPaths`` — a whole value, or one part
of a delimited string. A field path is dot-separated; ``\\.`` escapes a dot; ``[name=value]``
picks list elements by a field; a number picks by position; ``*`` is every element. A missing
target field is an error unless ``options.create`` (kustomize ≥ 5 behaviour).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from ruamel.yaml.comments import CommentedMap

from fnkernel.runtime_server.krm.resources.resourcelist import (
    ERROR,
    ResourceList,
    Result,
    api_group,
    kind,
)

# A field path's parts: ``[...]`` (which may hold dots: a key such as
# ``[app.kubernetes.io/app]``, or a list element ``[name=web]``), or a run of characters up to
# an unescaped dot.
_PART = re.compile(r"\[[^\]]*\]|(?:\\.|[^.\[])+")


class ReplacementError(ValueError):
    pass


def split_path(path: str) -> list[str]:
    """``spec.template.[app.kubernetes.io/name]`` → ["spec", "template", "[app.kubernetes.io/name]"]."""
    return [part.replace("\\.", ".") for part in _PART.findall(path)]


def _key(part: str) -> str:
    """A map key a part names: ``[k]`` (brackets let a key hold dots) or ``k``."""
    return part[1:-1] if part.startswith("[") and part.endswith("]") and "=" not in part else part


def _version(obj: Mapping[str, Any]) -> str:
    return str(obj.get("apiVersion", "")).rpartition("/")[2]


def _matches_selector(selector: str, values: Mapping[str, Any]) -> bool:
    """``a=b,c!=d,e`` (equality, inequality and existence terms)."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if str(values.get(key.strip())) == value.strip():
                return False
        elif "=" in term:
            key, value = term.split("=", 1)
            if str(values.get(key.strip().rstrip("="))) != value.strip().lstrip("="):
                return False
        elif term.strip() not in values:
            return False
    return True


def selects(obj: Mapping[str, Any], selector: Mapping[str, Any]) -> bool:
    meta = obj.get("metadata") or {}
    checks = {
        "group": api_group(obj),  # type: ignore[arg-type]
        "version": _version(obj),
        "kind": kind(obj),  # type: ignore[arg-type]
        "name": str(meta.get("name", "")),
        "namespace": str(meta.get("namespace", "") or ""),
    }
    for key, actual in checks.items():
        wanted = selector.get(key)
        if wanted is not None and str(wanted) != actual:
            return False
    if selector.get("labelSelector") and not _matches_selector(
        str(selector["labelSelector"]), meta.get("labels") or {}
    ):
        return False
    return not (
        selector.get("annotationSelector")
        and not _matches_selector(
            str(selector["annotationSelector"]), meta.get("annotations") or {}
        )
    )


def _children(node: Any, part: str, create: bool) -> Iterator[tuple[Any, Any]]:
    """(container, key) pairs that `part` names below `node`."""
    if isinstance(node, list):
        if part == "*":
            yield from ((node, index) for index in range(len(node)))
        elif part.isdigit():
            if int(part) < len(node):
                yield node, int(part)
        elif part.startswith("[") and part.endswith("]") and "=" in part:
            field, value = part[1:-1].split("=", 1)
            for index, element in enumerate(node):
                if isinstance(element, dict) and str(element.get(field)) == value:
                    yield node, index
        return
    if isinstance(node, dict):
        key = _key(part)
        if key not in node and create:
            node[key] = CommentedMap()
        if key in node:
            yield node, key


def find(obj: Any, path: list[str], *, create: bool = False) -> list[tuple[Any, Any]]:
    """Every (container, key) the path leads to; the last part is created when `create`."""
    places: list[tuple[Any, Any]] = [({"": obj}, "")]
    for position, part in enumerate(path):
        last = position == len(path) - 1
        found = []
        for container, key in places:
            node = container[key]
            if last and isinstance(node, dict):
                if _key(part) in node or create:
                    found.append((node, _key(part)))
            else:
                found += list(_children(node, part, create and not last))
        places = found
    return places


def _part(value: str, options: Mapping[str, Any]) -> str:
    delimiter = options.get("delimiter")
    if not delimiter:
        return value
    parts = value.split(str(delimiter))
    index = int(options.get("index", 0))
    if not 0 <= index < len(parts):
        raise ReplacementError(f"options.index {index} is out of range for {value!r}")
    return parts[index]


def _with_part(current: Any, value: Any, options: Mapping[str, Any]) -> Any:
    delimiter = options.get("delimiter")
    if not delimiter:
        return value
    parts = str(current or "").split(str(delimiter))
    index = int(options.get("index", 0))
    if index < 0:
        raise ReplacementError(f"options.index {index} must not be negative")
    while len(parts) <= index:
        parts.append("")
    parts[index] = str(value)
    return str(delimiter).join(parts)


def source_value(items: list[Any], replacement: Mapping[str, Any]) -> Any:
    if "sourceValue" in replacement:
        return replacement["sourceValue"]
    source = replacement.get("source")
    if not isinstance(source, Mapping):
        raise ReplacementError("a replacement needs source or sourceValue")
    candidates = [item for item in items if selects(item, source)]
    if len(candidates) != 1:
        raise ReplacementError(
            f"source {dict(source)} must select exactly one resource, selected {len(candidates)}"
        )
    path = str(source.get("fieldPath") or "metadata.name")
    places = find(candidates[0], split_path(path))
    if not places:
        raise ReplacementError(f"source fieldPath {path} not found")
    container, key = places[0]
    value = container[key]
    options = source.get("options") or {}
    return _part(str(value), options) if options.get("delimiter") else value


def apply(items: list[Any], replacement: Mapping[str, Any]) -> int:
    value = source_value(items, replacement)
    changed = 0
    for target in replacement.get("targets") or []:
        select = target.get("select") or {}
        rejects = target.get("reject") or []
        options = target.get("options") or {}
        for item in items:
            if not selects(item, select) or any(selects(item, r) for r in rejects):
                continue
            for path in target.get("fieldPaths") or ["metadata.name"]:
                places = find(item, split_path(str(path)), create=bool(options.get("create")))
                if not places:
                    raise ReplacementError(
                        f"unable to find field {path} in {kind(item)}/"
                        f"{(item.get('metadata') or {}).get('name', '')} (set options.create)"
                    )
                for container, key in places:
                    new = _with_part(
                        container.get(key) if isinstance(container, dict) else container[key],
                        value,
                        options,
                    )
                    if isinstance(container, dict) and container.get(key) == new:
                        continue
                    container[key] = new
                    changed += 1
    return changed


def apply_replacements(rl: ResourceList) -> None:
    config = rl.function_config
    if not config or kind(config) != "ApplyReplacements":
        rl.add_results(
            [Result("functionConfig must be a fn.kpt.dev/v1alpha1 ApplyReplacements", ERROR)]
        )
        return
    replacements = config.get("replacements")
    if not isinstance(replacements, list) or not replacements:
        rl.add_results(
            [Result("ApplyReplacements: `replacements` must be a non-empty list", ERROR)]
        )
        return
    for number, replacement in enumerate(replacements, 1):
        try:
            apply(rl.items, replacement)
        except ReplacementError as exc:
            rl.add_results([Result(f"replacement {number}: {exc}", ERROR)])
            return
    # The catalog's function reports nothing when it succeeds; nor does this one.
