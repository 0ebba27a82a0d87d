"""Every dotted name our docs and comments put in backticks names something that exists
(``make lint``; docs/architecture.md, "Where is it handled").

A backticked ``module.name``, ``Class.attribute``, ``path/to/file.py`` or
``path/to/file.py: name`` is checked when its first part is one of ours — a module (``wire``,
``lifecycle.runtimed``, ``runtime_server.rpc``), a top-level class or function, or a file — and
anything else in backticks (a Kubernetes field, a file a user writes) is left alone. Names are
looked up in the source, by its syntax tree, never by importing it.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("runtime_server", "adapters", "kernel", "system")
DISTRIBUTION = "fnkernel"  # the name they install under: fnkernel.kernel is kernel/
TEXTS = ("README.md", "docs", *PACKAGES, "tests", "benchmarks", "tools", "Makefile")
SKIPPED = ("tests/tools",)  # this checker's own tests, whose names are wrong on purpose
SUFFIXES = {".md", ".py", ".sh", ""}
# ``a.b``, `a.b`, `a/b.py`, `a/b.py: c.d`
_DOTTED = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+"
_PATH = r"[\w./-]+\.(?:py|sh|md|toml|ipynb)"
_TOKEN = re.compile(rf"``?({_PATH}(?::\s*[\w.]+)?|{_DOTTED})``?")
# What a dotted name's last part is when it is a file, not an attribute.
_FILE_ENDINGS = {"py", "sh", "md", "db", "log", "json", "yaml", "yml", "toml", "ipynb", "txt"}
_DOMAINS = {"dev", "io", "com", "org"}


@dataclass
class Module:
    path: Path
    names: dict[str, set[str]] = field(default_factory=dict)  # top-level name → its attributes
    own: set[str] = field(default_factory=set)  # the top-level names defined here, not imported
    variables: set[str] = field(default_factory=set)  # the names its functions use

    @classmethod
    def read(cls, path: Path) -> Module:
        module = cls(path)
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.arg):
                module.variables.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                module.variables.add(node.id)
        for node in tree.body:
            for name in _bound(node):
                module.names.setdefault(name, set())
                if not isinstance(node, ast.Import | ast.ImportFrom):
                    module.own.add(name)
            if isinstance(node, ast.ClassDef):
                # with those of its bases defined above it here (a Protocol made of two)
                inherited = (
                    module.names.get(b.id, set()) for b in node.bases if isinstance(b, ast.Name)
                )
                module.names[node.name] = _attributes(node).union(*inherited)
        return module


def _bound(node: ast.stmt) -> Iterator[str]:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        yield node.name
    elif isinstance(node, ast.Assign):
        for target in node.targets:
            yield from (n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    elif isinstance(node, ast.AnnAssign | ast.AugAssign) and isinstance(node.target, ast.Name):
        yield node.target.id
    elif isinstance(node, ast.Import | ast.ImportFrom):
        for alias in node.names:
            yield (alias.asname or alias.name).split(".")[0]
    elif isinstance(node, ast.If | ast.Try):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                yield from _bound(child)


def _attributes(cls: ast.ClassDef) -> set[str]:
    """A class's methods, class attributes, and every ``self.X`` assigned in its methods."""
    found: set[str] = set()
    for node in cls.body:
        found.update(_bound(node))
        if isinstance(node, ast.ClassDef):
            found.add(node.name)
    for node in ast.walk(cls):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            found.add(node.attr)
    return found


class Index:
    """Our modules by every dotted suffix of their name, and our top-level classes by name."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.modules: dict[str, list[Module]] = {}
        self.classes: dict[str, list[tuple[Module, str]]] = {}
        self.defined: dict[str, list[Module]] = {}  # every top-level name, where it is
        self.variables: set[str] = set()  # every local name and parameter (spec, run, self, …)
        self.files = [p for package in PACKAGES for p in (root / package).rglob("*") if p.is_file()]
        for path in self.files:
            if path.suffix != ".py" or "_proto" in path.parts:
                continue
            module = Module.read(path)
            self.variables |= module.variables
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            for start in range(len(parts)):
                self.modules.setdefault(".".join(parts[start:]), []).append(module)
            for name in module.own:
                self.defined.setdefault(name, []).append(module)
            for name in module.own:  # where a class is defined, not where it is imported
                attributes = module.names[name]
                if attributes or name[:1].isupper():
                    self.classes.setdefault(name, []).append((module, name))

    def file(self, text: str) -> Path | None:
        """A path as the docs write it: from the repository root, or from a package in it."""
        for path in self.files:
            relative = path.relative_to(self.root).as_posix()
            if relative == text or relative.endswith("/" + text):
                return path
        return None

    def problem(self, token: str) -> str | None:
        """What is wrong with `token`, or None when it resolves or is none of ours."""
        if re.fullmatch(_PATH + r"(?::\s*[\w.]+)?", token):
            path_text, _, name = token.partition(":")
            if not path_text.startswith(PACKAGES) and "/" not in path_text:
                return None  # a bare file name (handler.py, runs.db): a user's, or an example
            path = self.root / path_text
            if not path.exists():
                path = self.file(path_text)
            if path is None:
                top = path_text.split("/")[0]
                ours = (self.root / top).is_dir() or any(
                    (self.root / package / top).is_dir() for package in PACKAGES
                )
                return f"no file {path_text}" if ours else None
            name = name.strip()
            if not name or path.suffix != ".py":
                return None
            return self._in_module(Module.read(path), name.split("."), token)
        parts = token.removeprefix(f"{DISTRIBUTION}.").split(".")
        if parts[-1] in _FILE_ENDINGS | _DOMAINS or "__mutmut_" in parts[-1]:
            return None  # a file, a domain name (kptfile.kpt.dev), a mutant's name
        if _FILE_ENDINGS.intersection(parts[1:-1]):
            return None  # a file's name with more after its type (files.json.part)
        for cut in range(len(parts) - 1, 0, -1):  # the longest module prefix wins
            modules = self.modules.get(".".join(parts[:cut]))
            if modules:
                problems = [self._in_module(m, parts[cut:], token) for m in modules]
                return None if None in problems else problems[0]
        homes = self.classes.get(parts[0])
        if homes:
            problems = [self._in_module(m, parts, token) for m, _ in homes]
            return None if None in problems else problems[0]
        defined = self.defined.get(parts[-1])
        if len(parts) == 2 and defined and parts[0] not in self.variables:
            # launch.spawn, say: a module of ours that is not (or no longer) there
            where = ", ".join(sorted(str(m.path.relative_to(self.root)) for m in defined))
            return f"{token}: no module {parts[0]} ({parts[-1]} is in {where})"
        return None

    def _in_module(self, module: Module, names: list[str], token: str) -> str | None:
        first, rest = names[0], names[1:]
        where = module.path.relative_to(self.root)
        if first not in module.names:
            submodule = module.path.parent / first
            if module.path.name == "__init__.py" and (
                submodule.with_suffix(".py").exists() or (submodule / "__init__.py").exists()
            ):
                return None
            return f"{token}: {where} defines no {first}"
        if rest and module.names[first] and rest[0] not in module.names[first]:
            return f"{token}: {first} in {where} has no {rest[0]}"
        return None


def texts(root: Path) -> Iterator[Path]:
    for name in TEXTS:
        path = root / name
        if path.is_file():
            yield path
        elif path.is_dir():
            yield from (
                p
                for p in sorted(path.rglob("*"))
                if p.is_file()
                and p.suffix in SUFFIXES
                and "_proto" not in p.parts
                and not p.relative_to(root).as_posix().startswith(SKIPPED)
            )


def check(root: Path = ROOT) -> list[str]:
    index = Index(root)
    problems = []
    for path in texts(root):
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for match in _TOKEN.finditer(line):
                problem = index.problem(match.group(1))
                if problem is not None:
                    problems.append(f"{path.relative_to(root)}:{number}: {problem}")
    return problems


def main() -> int:
    problems = check()
    for problem in problems:
        print(problem)
    if problems:
        print(f"{len(problems)} name(s) in backticks name nothing that exists", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
