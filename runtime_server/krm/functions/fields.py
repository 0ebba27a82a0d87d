"""The field walk the catalog's setter and search functions share (docs/krm.md, "Builtin
functions"): every field of a resource with kpt's field path (``spec.containers[0].image``), its
value's text as Go's YAML reads it, and the comment at the end of its line.

A ruamel.yaml scalar has no node of its own, so a field is reached through the mapping or
sequence that holds it; so is its end-of-line comment (a block sequence's comment, which Go
keeps on the key, sits there too).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from ruamel.yaml.comments import CommentedSeq
from ruamel.yaml.error import CommentMark
from ruamel.yaml.scalarstring import (
    DoubleQuotedScalarString,
    FoldedScalarString,
    LiteralScalarString,
    SingleQuotedScalarString,
)
from ruamel.yaml.tokens import CommentToken

from fnkernel.runtime_server.krm.resources.package import LEGACY_PATH_ANNOTATION, PATH_ANNOTATION
from fnkernel.runtime_server.krm.resources.resourcelist import (
    InvalidResourceList,
    annotations_of,
    dump,
    load,
)

_STYLED = (
    DoubleQuotedScalarString,
    SingleQuotedScalarString,
    LiteralScalarString,
    FoldedScalarString,
)


@dataclass(frozen=True)
class Field:
    """The value under `key` of `holder` (a mapping's key or a sequence's index), at `path`."""

    holder: Any
    key: Any
    path: str

    @property
    def value(self) -> Any:
        return self.holder[self.key]

    @property
    def text(self) -> str:
        return text_of(self.value)

    def set_text(self, text: str) -> None:
        """Give the field the value `text` reads as, in the field's quoting (Go's YAML writer
        with the tag left to the value); the field's comment follows it one space on."""
        self.holder[self.key] = implicit(text, self.value)
        token = self._token()
        if token is not None:
            token.column = 0

    @property
    def comment(self) -> str:
        """The comment on the field's line (``# kpt-set: ${tag}``), or ``""``."""
        token = self._token()
        return token.value.split("\n", 1)[0].strip() if token is not None else ""

    def set_comment(self, text: str) -> None:
        """Put `text` at the end of the field's line, ``# `` first unless it starts with
        ``#``, keeping the full-line comments that follow it."""
        line = text if text.startswith("#") else f"# {text}"
        token = self._token()
        rest = token.value.split("\n", 1)[1] if token is not None and "\n" in token.value else ""
        new = CommentToken(f"{line}\n{rest}", CommentMark(0), None)
        slots = self.holder.ca.items.setdefault(self.key, [None, None, None, None])
        slots[self._slot()] = new

    def _slot(self) -> int:
        return 2 if isinstance(self.holder, dict) else 0

    def _token(self) -> CommentToken | None:
        slots = self.holder.ca.items.get(self.key)
        token = slots[self._slot()] if slots else None
        return token if isinstance(token, CommentToken) else None


class Visitor(Protocol):
    def visit_mapping(self, mapping: dict[Any, Any], path: str) -> None:
        """Called for each mapping before its fields are walked."""

    def visit_scalar(self, field: Field) -> None:
        """Called for each field whose value is a scalar."""


def accept(visitor: Visitor, node: Any, path: str = "") -> None:
    """Walk `node` as the catalog's functions do: a mapping is visited, then each of its
    fields in order (``.key``), each element of a sequence (``[i]``), scalars last."""
    if isinstance(node, dict):
        visitor.visit_mapping(node, path)
        for key in list(node):
            _child(visitor, Field(node, key, f"{path}.{text_of(key)}"))
    elif isinstance(node, list):
        for index in range(len(node)):
            _child(visitor, Field(node, index, f"{path}[{index}]"))


def _child(visitor: Visitor, field: Field) -> None:
    value = field.value
    if isinstance(value, dict | list):
        accept(visitor, value, field.path)
    else:
        visitor.visit_scalar(field)


def sequences(mapping: dict[Any, Any], path: str) -> Iterator[Field]:
    """The fields of `mapping` whose value is a sequence, with their paths."""
    for key, value in mapping.items():
        if isinstance(value, list):
            yield Field(mapping, key, f"{path}.{text_of(key)}".removeprefix("."))


def text_of(value: Any) -> str:
    """A scalar's text as Go's YAML node holds it: ``true``, ``3``, ``1.10``, ``""`` for null."""
    if isinstance(value, str):
        return str(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return ""
    if type(value) is int:
        return str(value)
    return rendered(value)  # a float or a hex int keeps its spelling


def rendered(value: Any) -> str:
    """`value` written as YAML, in its own style (``"3"`` for a double-quoted string)."""
    return dump(value).decode().removesuffix("...\n").strip()


def implicit(text: str, like: Any = None) -> Any:
    """The value `text` becomes when written in the style of `like` with its tag left to the
    reader: quoted or block styles keep the string; plain text becomes what it reads as (an
    int, a bool, …), spelt as given."""
    if isinstance(like, _STYLED):
        return type(like)(text)
    if not text:
        return DoubleQuotedScalarString("")
    try:
        value = load(text)
    except InvalidResourceList:
        return text
    if isinstance(value, dict | list | str):
        return text
    return value if rendered(value) == text else text


def block(sequence: CommentedSeq) -> CommentedSeq:
    sequence.fa.set_block_style()
    return sequence


def file_path(obj: dict[str, Any]) -> str:
    """The file a resource came from (kpt's path annotation, either spelling)."""
    notes = annotations_of(obj)
    return str(notes.get(PATH_ANNOTATION) or notes.get(LEGACY_PATH_ANNOTATION) or "")


def data_map(config: Any) -> dict[str, str]:
    """A function config's ``data``, each value as its text (kyaml's GetDataMap)."""
    data = config.get("data") if isinstance(config, dict) else None
    if not isinstance(data, dict):
        return {}
    return {text_of(key): text_of(value) for key, value in data.items()}
