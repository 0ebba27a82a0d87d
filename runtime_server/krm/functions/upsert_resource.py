"""``upsert-resource``, as the catalog's function behaves (docs/krm.md, "Builtin functions").

The function config is the resource to upsert (or a ``List`` of them). Each replaces every
resource of the same group, kind, name and namespace, which keeps its file; one that matches
none is added, in a new file, or in the file its ``config.kubernetes.io/target-path`` annotation
names (which also narrows the match to the resources of that file).
"""

from __future__ import annotations

from typing import Any

from ruamel.yaml.comments import CommentedMap

from fnkernel.runtime_server.krm.functions.fields import file_path
from fnkernel.runtime_server.krm.resources.package import INTERNAL, PATH_ANNOTATION
from fnkernel.runtime_server.krm.resources.resourcelist import (
    FunctionFailure,
    ResourceList,
    annotations_of,
    api_group,
    deep_copy,
    kind,
    metadata,
)

TARGET_PATH = "config.kubernetes.io/target-path"
# kpt 0.x's function annotations: a resource carrying one is a function config, never replaced.
FUNCTION_ANNOTATIONS = ("config.kubernetes.io/function", "config.k8s.io/function")


def _key(obj: dict[str, Any]) -> tuple[str, str, str, str]:
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
    return (
        api_group(obj),
        kind(obj),
        str(meta.get("name", "") or ""),  # type: ignore[union-attr]
        str(meta.get("namespace", "") or ""),  # type: ignore[union-attr]
    )


def _same(wanted: dict[str, Any], existing: dict[str, Any]) -> bool:
    target = str(annotations_of(wanted).get(TARGET_PATH, "") or "")
    return _key(wanted) == _key(existing) and (not target or target == file_path(existing))


def _set_annotations(obj: dict[str, Any], notes: dict[str, Any]) -> None:
    """Replace the annotations, sorted as Go's YAML library writes a map; none at all
    removes the field."""
    meta = metadata(obj)
    if notes:
        meta["annotations"] = CommentedMap(sorted(notes.items()))
    else:
        meta.pop("annotations", None)


def _own_annotations(obj: dict[str, Any]) -> dict[str, Any]:
    """The config's annotations a written resource keeps: not kpt's internal ones, the
    function annotations or the target path."""
    dropped = (*INTERNAL, *FUNCTION_ANNOTATIONS, TARGET_PATH)
    return {k: v for k, v in annotations_of(obj).items() if k not in dropped}


def upsert(items: list[dict[str, Any]], wanted: dict[str, Any]) -> None:
    replaced = False
    for index, existing in enumerate(items):
        notes = annotations_of(existing)
        if any(notes.get(key) for key in FUNCTION_ANNOTATIONS) or not _same(wanted, existing):
            continue
        new = deep_copy(wanted)
        kept = {k: v for k, v in notes.items() if k in INTERNAL}
        _set_annotations(new, {**_own_annotations(wanted), **kept})
        items[index] = new
        replaced = True
    if replaced:
        return
    new = deep_copy(wanted)
    target = str(annotations_of(wanted).get(TARGET_PATH, "") or "")
    _set_annotations(
        new, {**_own_annotations(wanted), **({PATH_ANNOTATION: target} if target else {})}
    )
    items.append(new)


def upsert_resource(rl: ResourceList) -> None:
    config = rl.function_config
    if config is None or not kind(config):
        rl.stderr.append("failed to upsert resource: missing Resource metadata")
        raise FunctionFailure
    wanted = config.get("items") if kind(config) == "List" else [config]
    for resource in wanted or []:
        if isinstance(resource, dict):
            upsert(rl.items, resource)
