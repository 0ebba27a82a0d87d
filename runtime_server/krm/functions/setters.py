"""The catalog's setter functions, as their Go sources behave (docs/krm.md, "Builtin functions").

A *setter* is a ``# kpt-set: PATTERN`` comment at the end of a field's line: ``${name}`` in the
pattern stands for the setter's value. ``apply-setters`` writes the values a config gives into the
fields so marked; ``create-setters`` marks the fields whose values the config names;
``list-setters`` reports the setters a package has, with the values the Kptfile's apply-setters
steps give them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ruamel.yaml.comments import CommentedSeq

from fnkernel.runtime_server.krm.functions.fields import (
    Field,
    accept,
    block,
    data_map,
    file_path,
    rendered,
    sequences,
    text_of,
)
from fnkernel.runtime_server.krm.resources.kptfile import go_quote
from fnkernel.runtime_server.krm.resources.resourcelist import (
    ERROR,
    WARNING,
    InvalidResourceList,
    ResourceList,
    Result,
    load,
)

SETTER_COMMENT = "# kpt-set: "
_REFERENCE = re.compile(r"\$\{[^}]*\}")


def pattern_of(comment: str) -> str:
    """The setter pattern of a field's line comment, or ``""`` when it is not a setter."""
    if not comment.startswith(SETTER_COMMENT):
        return ""
    return comment.removeprefix(SETTER_COMMENT).strip()


def references(pattern: str) -> list[str]:
    """The ``${name}`` references in a pattern, in order."""
    return _REFERENCE.findall(pattern)


def name_of(reference: str) -> str:
    return reference.strip().removeprefix("${").removesuffix("}")


def current_values(pattern: str, value: str) -> dict[str, str]:
    """The setter values `value` holds for `pattern`'s references: for
    ``app.${stage}.${tld}`` and ``app.dev.com``, stage=dev and tld=com. Empty unless every
    reference has a non-empty value."""
    names = references(pattern)
    regex = re.escape(pattern)
    for reference in names:
        regex = regex.replace(re.escape(reference), "(.*)")
    try:
        found = re.search(regex, value)
    except re.error:
        return {}
    if found is None or len(found.groups()) != len(names) or not all(found.groups()):
        return {}
    return {name_of(reference): text for reference, text in zip(names, found.groups(), strict=True)}


def _parsed(text: str) -> Any:
    try:
        return load(text)
    except InvalidResourceList:
        return None


# apply-setters


@dataclass
class _Apply:
    setters: dict[str, str]
    file: str = ""
    results: list[Result] = field(default_factory=list)

    def wanted(self, pattern: str) -> bool:
        return any(f"${{{name}}}" in pattern for name in self.setters)

    def visit_mapping(self, mapping: dict[Any, Any], path: str) -> None:
        for seq in sequences(mapping, path):
            pattern = pattern_of(seq.comment)
            if not pattern or not self.wanted(pattern):
                continue
            if len(references(pattern)) != 1 or not (
                pattern.startswith("${") and pattern.endswith("}")
            ):
                raise ValueError(f"invalid setter pattern for array node: {go_quote(pattern)}")
            value = self.setters.get(name_of(pattern), "")
            if not value:
                empty = CommentedSeq()
                empty.fa.set_flow_style()
                mapping[seq.key] = empty
            else:
                parsed = _parsed(value)
                if not isinstance(parsed, CommentedSeq):
                    raise ValueError(
                        f"input to array setter must be an array of values, but found "
                        f"{go_quote(value)}"
                    )
                mapping[seq.key] = block(parsed)
            seq.set_comment(seq.comment)  # one space after the key or the `[]`
            self.results.append(_set_result(value, seq.path, self.file))

    def visit_scalar(self, field: Field) -> None:
        pattern = pattern_of(field.comment)
        if not pattern or not self.wanted(pattern):
            return
        text = pattern
        for name, value in self.setters.items():
            text = text.replace(f"${{{name}}}", value)
        for name, value in current_values(pattern, field.text).items():
            text = text.replace(f"${{{name}}}", value)
        unresolved = references(text)
        if unresolved:
            raise ValueError(f"values for setters [{' '.join(unresolved)}] must be provided")
        if text != field.text:
            field.set_text(text)
        self.results.append(_set_result(text, field.path.removeprefix("."), self.file))


def _set_result(value: str, path: str, file: str) -> Result:
    return Result(f"set field value to {go_quote(value)}", "", field_path=path, file_path=file)


def apply_setters(rl: ResourceList) -> None:
    """Write the config's ``data`` values into the fields their setters mark: a scalar gets
    its pattern with every reference filled in (from the config, else from the field's
    current value); a sequence marked ``${name}`` gets the value's list."""
    applier = _Apply(data_map(rl.function_config))
    try:
        for item in rl.items:
            applier.file = file_path(item)
            accept(applier, item)
    except ValueError as exc:
        rl.add_results([Result(f"failed to apply setters: {exc}", ERROR)])
        return
    rl.add_results(applier.results or [Result("no matches for input setter(s)", "")])


# create-setters


@dataclass
class _Create:
    scalars: dict[str, str]  # value -> name, longest value first
    arrays: list[tuple[str, list[str]]]
    file: str = ""
    results: list[Result] = field(default_factory=list)

    def __post_init__(self) -> None:
        alternatives = "|".join(re.escape(value) for value in self.scalars)
        self._values = re.compile(alternatives) if alternatives else None

    def replaced(self, text: str) -> str:
        """`text` with each setter's value replaced by its reference, longest value first,
        left to right and never overlapping (Go's strings.Replacer)."""
        if self._values is None:
            return text
        return self._values.sub(lambda found: f"${{{self.scalars[found.group()]}}}", text)

    def visit_mapping(self, mapping: dict[Any, Any], path: str) -> None:
        for seq in sequences(mapping, path):
            values = sorted(text_of(element) for element in seq.value)
            flow = seq.value.fa.flow_style()
            if flow and any(self.replaced(value) != value for value in values):
                block(seq.value)  # its elements get comments of their own
                flow = False
            for name, wanted in self.arrays:
                if values == wanted:
                    if flow and values:
                        block(seq.value)
                    comment = f"kpt-set: ${{{name}}}"
                    seq.set_comment(comment)
                    shown = "[" + " ".join(values) + "]"
                    self.results.append(self._result(comment, shown, seq.path))
                    break

    def visit_scalar(self, field: Field) -> None:
        text = field.text
        if "\n" in text:
            return
        pattern = self.replaced(text)
        if pattern != text:
            comment = f"kpt-set: {pattern}"
            field.set_comment(comment)
            self.results.append(self._result(comment, text, field.path.removeprefix(".")))

    def _result(self, comment: str, value: str, path: str) -> Result:
        message = f"Added line comment {go_quote(comment)} for field with value {go_quote(value)}"
        return Result(message, "", field_path=path, file_path=self.file)


def _creator(config: Any) -> _Create:
    data = data_map(config)
    if not data:
        raise ValueError("config map cannot be empty")
    scalars: list[tuple[str, str]] = []
    arrays: list[tuple[str, list[str]]] = []
    for name, value in data.items():
        try:
            parsed = load(value)
        except InvalidResourceList:
            raise ValueError("parsing error") from None
        if isinstance(parsed, list):
            arrays.append((name, sorted(text_of(element) for element in parsed)))
        elif not isinstance(parsed, dict) and value:
            scalars.append((value, name))
    scalars.sort(key=lambda pair: len(pair[0]), reverse=True)
    by_value: dict[str, str] = {}
    for value, name in scalars:
        by_value.setdefault(value, name)
    return _Create(by_value, arrays)


def create_setters(rl: ResourceList) -> None:
    """Mark with ``# kpt-set:`` each field whose value holds a setter value of the config
    (the value replaced by ``${name}`` in the pattern), and each sequence whose elements are
    an array setter's. No match at all is an error, as in the catalog."""
    try:
        creator = _creator(rl.function_config)
        for item in rl.items:
            creator.file = file_path(item)
            accept(creator, item)
        if not creator.results:
            raise ValueError("no matches for the input list of setters")
    except ValueError as exc:
        rl.add_results([Result(f"failed to create setters: {exc}", ERROR)])
        return
    rl.add_results(creator.results)


# list-setters


@dataclass
class _Setter:
    value: str
    kind: str
    count: int = 0


@dataclass
class _List:
    scalars: dict[str, _Setter] = field(default_factory=dict)
    arrays: dict[str, _Setter] = field(default_factory=dict)

    def visit_mapping(self, mapping: dict[Any, Any], path: str) -> None:
        for seq in sequences(mapping, path):
            pattern = pattern_of(seq.comment)
            if not pattern:
                continue
            name = name_of(pattern)
            if name in self.arrays:
                self.arrays[name].count += 1
            else:
                values = sorted(text_of(element) for element in seq.value)
                self.arrays[name] = _Setter("[" + ", ".join(values) + "]", "array", 1)

    def visit_scalar(self, field: Field) -> None:
        pattern = pattern_of(field.comment)
        if not pattern:
            return
        kind = _yaml_type(field.value)
        for name, value in current_values(pattern, field.text).items():
            setter = self.scalars.get(name)
            if setter is None:
                self.scalars[name] = _Setter(value, kind, 1)
                continue
            if setter.kind == "str" and kind != "str":
                setter.kind = kind
            setter.count += 1

    def add_declared(self, setters: dict[str, str]) -> None:
        for name, value in setters.items():
            parsed = _parsed(value) if value else None
            if isinstance(parsed, list):
                shown = ", ".join(rendered(element).replace("\n", "") for element in parsed)
                self.arrays[name] = _Setter(f"[{shown}]", "array")
            else:
                self.scalars[name] = _Setter(value, "str")


def _yaml_type(value: Any) -> str:
    """The YAML tag a scalar resolves to, as list-setters reports it."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    return "null" if value is None else "str"


def declared_setters(items: list[dict[str, Any]]) -> dict[str, str]:
    """The setter values the package's Kptfile gives its apply-setters steps (a later step
    wins), found among `items` (an eval with ``--include-meta-resources``); empty when there is
    no Kptfile, no pipeline or no such step."""
    kptfile = next((item for item in items if file_path(item) == "Kptfile"), None)
    pipeline = kptfile.get("pipeline") if kptfile is not None else None
    if not isinstance(pipeline, dict):
        return {}
    found: dict[str, str] = {}
    for step in pipeline.get("mutators") or []:
        if not isinstance(step, dict) or "apply-setters" not in str(step.get("image", "")):
            continue
        if isinstance(step.get("configMap"), dict):
            found.update(data_map({"data": step["configMap"]}))
        elif step.get("configPath"):
            config = next((i for i in items if file_path(i) == step["configPath"]), None)
            if config is None:
                return {}
            found.update(data_map(config))
        else:
            return {}
    return found


def list_setters(rl: ResourceList) -> None:
    """One result per setter the resources' ``# kpt-set:`` comments and the Kptfile's
    apply-setters steps name: its value, type and how many fields it sets, by name."""
    lister = _List()
    lister.add_declared(declared_setters(rl.items))
    for item in rl.items:
        accept(lister, item)
    found = sorted(
        [(name, setter) for name, setter in lister.arrays.items()]
        + [(name, setter) for name, setter in lister.scalars.items()],
        key=lambda pair: pair[0],
    )
    if not found:
        rl.add_results([Result("no setters found", WARNING)])
        return
    rl.add_results(
        [
            Result(f"Name: {name}, Value: {s.value}, Type: {s.kind}, Count: {s.count}", "")
            for name, s in found
        ]
    )
