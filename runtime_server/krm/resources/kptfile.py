"""The Kptfile: what a valid one holds, and the form kpt writes it (and results.yaml) in
(docs/krm.md, "The Kptfile").

kpt reads a Kptfile strictly (``kpt.dev/v1`` only, no unknown field) and, after every render,
writes the top package's Kptfile back with the render's status. It writes it from its schema,
so the file comes out in kpt's field order, sequences indented under their key, map keys sorted,
without comments. We write it the same way (``canonical_text``); every other file keeps its
comments and layout.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import PurePosixPath
from typing import Any

from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.scalarstring import (
    DoubleQuotedScalarString,
    LiteralScalarString,
    SingleQuotedScalarString,
)

from fnkernel.runtime_server.krm.resources.resourcelist import yaml

API_VERSION = "kpt.dev/v1"
KIND = "Kptfile"
OLD_VERSIONS = ("kpt.dev/v1alpha1", "kpt.dev/v1alpha2")
SAVE_ON_FAILURE = "kpt.dev/save-on-render-failure"
BFS_RENDER = "kpt.dev/bfs-rendering"

# kpt's schema, as field → sub-schema, in the order kpt writes the fields. A string is a scalar;
# MAP a map of strings (written with sorted keys); [schema] a list of that schema.
MAP = "map"
_META = {"name": str, "namespace": str, "labels": MAP, "annotations": MAP}
_SELECTOR = {
    "apiVersion": str,
    "kind": str,
    "name": str,
    "namespace": str,
    "labels": MAP,
    "annotations": MAP,
}
FUNCTION = {
    "image": str,
    "exec": str,
    "configPath": str,
    "configMap": MAP,
    "name": str,
    "tag": str,
    "selectors": [_SELECTOR],
    "exclude": [_SELECTOR],
}
_GIT = {"repo": str, "directory": str, "ref": str, "commit": str}
_FIELD = {"path": str, "currentValue": str, "proposedValue": str}
_RESULT = {
    "message": str,
    "severity": str,
    "resourceRef": {"apiVersion": str, "kind": str, "name": str, "namespace": str},
    "field": _FIELD,
    "file": {"path": str, "index": int},
    "tags": MAP,
}
_STEP = {
    "name": str,
    "image": str,
    "exec": str,
    "executionError": str,
    "stderr": str,
    "exitCode": int,
    "results": [_RESULT],
    "errorResults": [_RESULT],
}
SCHEMA: dict[str, Any] = {
    "apiVersion": str,
    "kind": str,
    "metadata": _META,
    "upstream": {"type": str, "git": _GIT, "updateStrategy": str},
    "upstreamLock": {
        "type": str,
        "git": _GIT,
        "generic": {"storeID": str, "resourceID": str, "resourceVersion": str},
    },
    "info": {
        "site": str,
        "emails": [str],
        "license": str,
        "licenseFile": str,
        "description": str,
        "keywords": [str],
        "man": str,
        "readinessGates": [{"conditionType": str}],
    },
    "pipeline": {"mutators": [FUNCTION], "validators": [FUNCTION]},
    "inventory": {
        "namespace": str,
        "name": str,
        "inventoryID": str,
        "labels": MAP,
        "annotations": MAP,
    },
    "status": {
        "conditions": [{"type": str, "status": str, "reason": str, "message": str}],
        "renderStatus": {
            "mutationSteps": [_STEP],
            "validationSteps": [_STEP],
            "errorSummary": str,
        },
    },
}
# results.yaml, kpt's record of the functions a render or eval ran.
RESULTS_SCHEMA: dict[str, Any] = {
    "apiVersion": str,
    "kind": str,
    "metadata": {"name": str},
    "exitCode": int,
    "items": [{"image": str, "exec": str, "stderr": str, "exitCode": int, "results": [_RESULT]}],
}
# Fields kpt writes even when empty.
_ALWAYS = {"exitCode", "type", "status"}
# Strings Go's YAML writer quotes because they would read back as another type.
_NOT_PLAIN = {"true", "false", "yes", "no", "on", "off", "null", "~", ""}


class KptfileError(ValueError):
    """The Kptfile cannot be used; the message says why in kpt's words."""


def _type_name(schema: Mapping[str, Any]) -> str:
    if schema is FUNCTION:
        return "v1.Function"
    if schema is _SELECTOR:
        return "v1.Selector"
    return "v1.KptFile"


def unknown_fields(node: Any, schema: Any, found: list[str]) -> list[str]:
    """Every field of `node` the schema does not have, as Go's strict reader names them:
    ``line N: field F not found in type v1.T``."""
    if isinstance(schema, list) and isinstance(node, list):
        for element in node:
            unknown_fields(element, schema[0], found)
    elif isinstance(schema, dict) and isinstance(node, dict):
        for key in node:
            if key in schema:
                unknown_fields(node[key], schema[key], found)
                continue
            line = node.lc.key(key)[0] + 1 if hasattr(node, "lc") else 0
            found.append(f"line {line}: field {key} not found in type {_type_name(schema)}")
    return found


def _scalar_errors(node: Any, schema: Any, found: list[str]) -> list[str]:
    """Values of the wrong shape: a list or a map where the schema has a string."""
    if isinstance(schema, list) and isinstance(node, list):
        for element in node:
            _scalar_errors(element, schema[0], found)
    elif isinstance(schema, dict) and isinstance(node, dict):
        for key, value in node.items():
            if key in schema:
                _scalar_errors(value, schema[key], found)
    elif schema == MAP and isinstance(node, dict):
        for key, value in node.items():
            if isinstance(value, dict | list):
                line = node.lc.value(key)[0] + 1 if hasattr(node, "lc") else 0
                tag = "!!map" if isinstance(value, dict) else "!!seq"
                found.append(f"line {line}: cannot unmarshal {tag} into string")
    return found


def check(document: Any) -> None:
    """Raise KptfileError unless `document` is a Kptfile kpt would read."""
    if not isinstance(document, dict):
        raise KptfileError("can't be read.\n\nDetails:\nthe Kptfile is not a mapping")
    api_version = str(document.get("apiVersion", ""))
    if api_version in OLD_VERSIONS:
        version = api_version.rpartition("/")[2]
        raise KptfileError(f"has an old version ({go_quote(version)}) of the Kptfile schema")
    if api_version != API_VERSION or document.get("kind") != KIND:
        found = f"{api_version}, Kind={document.get('kind')}"
        raise KptfileError(f"has an unknown resource type ({go_quote(found)})")
    problems = unknown_fields(document, SCHEMA, []) + _scalar_errors(document, SCHEMA, [])
    if problems:
        details = "\n".join(f"  {problem}" for problem in problems)
        raise KptfileError(f"can't be read.\n\nDetails:\nyaml: unmarshal errors:\n{details}")


def validate_function(spec: Any, field: str) -> None:
    """One pipeline step: exactly one of image and exec, and not both configMap and configPath;
    a configPath relative and inside the package."""
    if not isinstance(spec, dict):
        raise KptfileError(invalid(field, "", "must be a function"))
    image, exec_ = spec.get("image"), spec.get("exec")
    if not image and not exec_:
        raise KptfileError(
            invalid(field, "", "must specify a functon (`image` or `exec`) to execute")
        )
    if image and exec_:
        raise KptfileError(
            invalid(field, "", "must not specify both `image` and `exec` at the same time")
        )
    if spec.get("configMap") and spec.get("configPath"):
        raise KptfileError(
            invalid(
                field,
                "",
                "functionConfig must not specify both `configMap` and `configPath` at the same time",
            )
        )
    config_path = spec.get("configPath")
    if config_path is not None:
        path = str(config_path)
        if not path.strip():
            raise KptfileError(invalid(f"{field}.configPath", path, "path must not be empty"))
        if PurePosixPath(path).is_absolute():
            raise KptfileError(invalid(f"{field}.configPath", path, "path must be relative"))
        if ".." in path:
            raise KptfileError(
                invalid(f"{field}.configPath", path, "path must not be outside the package")
            )


def invalid(field: str, value: str, reason: str) -> str:
    """kpt's form for a Kptfile field that is wrong."""
    text = f"Kptfile is invalid:\nField: `{field}`\n"
    if value:
        text += f"Value: {go_quote(value)}\n"
    return text + f"Reason: {reason}\n"


_GO_ESCAPES = {"\a": "a", "\b": "b", "\f": "f", "\n": "n", "\r": "r", "\t": "t", "\v": "v"}


def go_quote(text: str) -> str:
    """A string quoted as Go's %q quotes it: backslash escapes for quotes and control
    characters, printable Unicode as it is."""
    out = ['"']
    for char in text:
        if char in '"\\':
            out.append("\\" + char)
        elif char in _GO_ESCAPES:
            out.append("\\" + _GO_ESCAPES[char])
        elif char.isprintable():
            out.append(char)
        elif ord(char) < 0x80:
            out.append(f"\\x{ord(char):02x}")
        elif ord(char) < 0x10000:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(f"\\U{ord(char):08x}")
    out.append('"')
    return "".join(out)


def canonical(node: Any, schema: Any = SCHEMA) -> Any:
    """`node` as kpt writes it: schema order, empty fields left out, maps sorted, no comments."""
    if isinstance(schema, list):
        sequence = CommentedSeq(canonical(element, schema[0]) for element in node or [])
        return sequence
    if schema == MAP:
        return CommentedMap(sorted((str(k), _scalar(v)) for k, v in (node or {}).items()))
    if isinstance(schema, dict):
        mapping = CommentedMap()
        for key, sub in schema.items():
            value = node.get(key) if isinstance(node, Mapping) else None
            if value is None or (key not in _ALWAYS and value in ("", 0, [], {})):
                continue  # Go's omitempty
            mapping[key] = canonical(value, sub)
        return mapping
    return _scalar(node, schema)


def _scalar(value: Any, schema: Any = str) -> Any:
    """A string quoted as Go's YAML writer quotes it: a literal block when it has lines,
    double quotes when plain it would read back as another type, single quotes when it cannot
    be plain, plain otherwise."""
    if schema is int:
        return int(value)
    text = str(value)
    if "\n" in text:
        return LiteralScalarString(text)
    if text.lower() in _NOT_PLAIN or _looks_numeric(text):
        return DoubleQuotedScalarString(text)
    if _not_plain(text):
        return SingleQuotedScalarString(text)
    return text


def _not_plain(text: str) -> bool:
    return (
        text[0] in "-?:,[]{}#&*!|>'\"%@`"
        or text != text.strip()
        or ": " in text
        or " #" in text
        or text.endswith(":")
    )


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def canonical_text(document: Any, schema: Any = SCHEMA) -> str:
    """The Kptfile's text (or, with RESULTS_SCHEMA, results.yaml's) as kpt writes it."""
    codec = yaml()
    codec.indent(mapping=2, sequence=4, offset=2)
    out = io.StringIO()
    codec.dump(canonical(document, schema), out)
    return out.getvalue()


def rendered_condition(error: str) -> CommentedMap:
    """The ``Rendered`` condition: True after a render that succeeded, else False with why."""
    if not error:
        return CommentedMap(type="Rendered", status="True", reason="RenderSuccess")
    return CommentedMap(type="Rendered", status="False", reason="RenderFailed", message=error)


def with_status(
    document: Any,
    condition: Mapping[str, Any],
    mutation_steps: Sequence[Mapping[str, Any]],
    validation_steps: Sequence[Mapping[str, Any]],
    error_summary: str = "",
) -> Any:
    """`document` with its ``Rendered`` condition replaced and the render status set (none when
    no step ran), as kpt records a render."""
    status = document.get("status") if isinstance(document.get("status"), dict) else {}
    conditions = [c for c in status.get("conditions") or [] if c.get("type") != "Rendered"]
    new_status: dict[str, Any] = {"conditions": [*conditions, condition]}
    if mutation_steps or validation_steps:
        new_status["renderStatus"] = {
            "mutationSteps": list(mutation_steps),
            "validationSteps": list(validation_steps),
            "errorSummary": error_summary,
        }
    updated = dict(document)
    updated["status"] = new_status
    return updated
