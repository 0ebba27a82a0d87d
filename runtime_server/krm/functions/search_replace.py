"""``search-replace``, as the catalog's function behaves (docs/krm.md, "Builtin functions").

It matches fields by path (``spec.**.image``: ``*`` one element, ``**`` any number,
``containers[*]`` any index), by value or by a value regex, in files matching a glob, and puts a
value (``${1}`` from the regex's groups) or a line comment on each match; with only an absolute
path and a value, it sets that field in every resource, creating it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ruamel.yaml.comments import CommentedMap

from fnkernel.runtime_server.krm.functions.fields import (
    Field,
    accept,
    block,
    data_map,
    file_path,
    implicit,
    rendered,
    sequences,
)
from fnkernel.runtime_server.krm.resources.kptfile import go_quote
from fnkernel.runtime_server.krm.resources.resourcelist import (
    ERROR,
    ResourceList,
    Result,
    block_style,
    dump,
    load,
)

MATCHERS = ("by-value", "by-file-path", "by-value-regex", "by-path", "put-value", "put-comment")
_GROUP = re.compile(r"\$\{([0-9]+)\}")


def path_matches(path: str, pattern: str) -> bool:
    """Whether the field path `path` (``spec.containers[0].image``) matches `pattern`."""
    if not pattern:
        return False
    return _match(path.removeprefix(".").split("."), pattern.split("."))


def _match(elements: list[str], patterns: list[str]) -> bool:
    # matched[j]: the elements so far match the first j patterns.
    matched = [True] + [False] * len(patterns)
    for j, pattern in enumerate(patterns, 1):
        matched[j] = matched[j - 1] and pattern == "**"
    for element in elements:
        row = [False] * (len(patterns) + 1)
        for j, pattern in enumerate(patterns, 1):
            if pattern == "**":
                row[j] = row[j - 1] or matched[j]
            elif pattern == "*" or _element_matches(element, pattern):
                row[j] = matched[j - 1]
        matched = row
    return matched[-1]


def _element_matches(element: str, pattern: str) -> bool:
    if element == pattern:
        return True
    if "[" not in element:
        return False
    parts, wanted = element.split("["), pattern.split("[")
    if wanted[0] != "*" and wanted[0] != parts[0]:
        return False
    return len(wanted) > 1 and (wanted[1] == "*]" or wanted[1] == parts[1])


def glob_matches(pattern: str, path: str) -> bool:
    """A doublestar glob: ``**`` any number of directories, ``*`` and ``?`` within one,
    ``[…]`` classes and ``{a,b}`` alternatives."""
    return re.fullmatch(_glob_regex(pattern), path) is not None


def _glob_regex(pattern: str) -> str:
    out, i = [], 0
    while i < len(pattern):
        char = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if char == "*":
            out.append("[^/]*")
        elif char == "?":
            out.append("[^/]")
        elif char == "[" and "]" in pattern[i + 1 :]:
            end = pattern.index("]", i + 1)
            body = pattern[i + 1 : end].replace("\\", "\\\\")
            out.append("[" + ("^" + body[1:] if body.startswith(("!", "^")) else body) + "]")
            i = end
        elif char == "{" and "}" in pattern[i + 1 :]:
            end = pattern.index("}", i + 1)
            choices = pattern[i + 1 : end].split(",")
            out.append("(?:" + "|".join(_glob_regex(choice) for choice in choices) + ")")
            i = end
        else:
            out.append(re.escape(char))
        i += 1
    return "".join(out)


def is_absolute(path: str) -> bool:
    """A plain ``a.b.c`` path, with no wildcard."""
    return all(element and "*" not in element for element in path.split("."))


def resolve(value: str, regex: str, pattern: str) -> str:
    """`pattern` with ``${N}`` replaced by group N of `regex` matched in `value`."""
    if not regex:
        return pattern
    found = re.search(regex, value)
    result = pattern
    for number, group in enumerate(found.groups() if found else (), 1):
        result = result.replace(f"${{{number}}}", group or "")
    if _GROUP.search(result):
        raise ValueError("unable to resolve capture groups")
    return result


@dataclass
class SearchReplace:
    by_value: str = ""
    by_value_regex: str = ""
    by_path: str = ""
    by_file_path: str = ""
    put_value: str = ""
    put_comment: str = ""
    file: str = ""
    count: int = 0
    found: list[tuple[str, str, str]] = field(default_factory=list)  # file, path, value
    regex: re.Pattern[str] | None = None

    @classmethod
    def of(cls, config: object) -> SearchReplace:
        data = data_map(config)
        for key in data:
            if key not in MATCHERS:
                allowed = " ".join(go_quote(m) for m in MATCHERS)
                raise ValueError(f"invalid matcher {go_quote(key)}, must be one of [{allowed}]")
        found = cls(
            by_value=data.get("by-value", ""),
            by_value_regex=data.get("by-value-regex", ""),
            by_path=data.get("by-path", ""),
            by_file_path=data.get("by-file-path", ""),
            put_value=data.get("put-value", ""),
            put_comment=data.get("put-comment", ""),
        )
        if found.by_value and found.by_value_regex:
            raise ValueError('only one of ["by-value", "by-value-regex"] can be provided')
        if found.by_value_regex:
            try:
                found.regex = re.compile(found.by_value_regex)
            except re.error as exc:
                raise ValueError(f"error parsing regexp: {exc}") from None
        return found

    @property
    def mutates(self) -> bool:
        return bool(self.put_value or self.put_comment)

    def perform(self, obj: dict[str, Any]) -> None:
        self.file = file_path(obj)
        if self.by_file_path and not glob_matches(self.by_file_path, self.file):
            return
        if (
            is_absolute(self.by_path)
            and "[" not in self.by_path
            and not self.by_value
            and not self.by_value_regex
            and self.put_value
        ):
            self._put_at_path(obj)
            return
        accept(self, obj)

    def _put_at_path(self, obj: dict[str, Any]) -> None:
        *parents, last = self.by_path.split(".")
        node: dict[str, Any] = obj
        for key in parents:
            child = node.get(key)
            if child is None:
                child = node[key] = CommentedMap()
            if not isinstance(child, dict):
                raise ValueError(f"wrong node kind at {key}: expected a mapping")
            node = child
        node[last] = implicit(self.put_value)
        self.found.append((self.file, self.by_path, self.put_value))
        self.count += 1

    def visit_mapping(self, mapping: dict[Any, Any], path: str) -> None:
        if not self.put_comment:
            return
        for seq in sequences(mapping, path):
            if not seq.value or not path_matches(seq.path, self.by_path):
                continue
            seq.set_comment(self.put_comment)
            shown = rendered(_flow(seq.value))
            block(seq.value)
            self.found.append((self.file, f"{self.by_path} # {self.put_comment}", shown))
            self.count += 1

    def visit_scalar(self, field: Field) -> None:
        text = field.text
        path_match = path_matches(field.path, self.by_path)
        value_match = bool(self.by_value) and self.by_value == text
        if self.regex is not None:
            value_match = value_match or self.regex.search(text) is not None
        if not (
            (value_match and path_match)
            or (value_match and not self.by_path)
            or (path_match and not self.by_value and not self.by_value_regex)
        ):
            return
        self.count += 1
        if self.put_comment:
            field.set_comment(resolve(text, self.by_value_regex, self.put_comment))
        if self.put_value:
            field.set_text(resolve(text, self.by_value_regex, self.put_value))
        if self.file:
            shown = rendered(field.value)
            if field.comment:
                shown += " " + field.comment
            self.found.append((self.file, field.path.removeprefix("."), shown))


def _flow(sequence: object) -> object:
    """A copy of `sequence` written in flow style, as the catalog shows a matched list."""
    copy = load(dump(block_style(sequence)))
    copy.fa.set_flow_style()
    return copy


def search_replace(rl: ResourceList) -> None:
    try:
        search = SearchReplace.of(rl.function_config)
        for item in rl.items:
            search.perform(item)
    except ValueError as exc:
        message = f"failed to perform search-replace operation: {go_quote(str(exc))}"
        rl.add_results([Result(message, ERROR)])
        return
    if not search.found:
        rl.add_results([Result("no matches", "")])
        return
    verb = "Mutated field value to" if search.mutates else "Matched field value"
    rl.add_results(
        [
            Result(f"{verb} {go_quote(value)}", "", field_path=path, file_path=file)
            for file, path, value in search.found
        ]
    )
