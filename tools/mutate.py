"""Mutation testing of the Runtime Server's core: the score per file (docs/architecture.md,
"Mutation testing").

Runs ``mutmut run`` (configured in pyproject.toml: the files it mutates and the tests that
drive them), then reads every mutant's status and prints, per file, how many of its mutants
the tests killed. Survivors that a rule of ``tools/mutants_accepted.toml`` explains, as
equivalent (no behaviour changes) or accepted (with the reason), are left out of the score and
listed under their reason; every other survivor is printed with its diff: each is a test to
write, or a rule to add. Exit status 1 when a file scores under the target.

It runs mutmut in a staged copy of the project, ``build/mutate``, where the folders sit as they
install, ``src/fnkernel/<folder>``: mutmut names a mutant after its file's path (``src/``
stripped), and that name must be the module's own (``fnkernel.runtime_server.limits``) for a
test to reach the mutant. Every process the tests start imports the mutated copy too
(``PYTHONPATH``).

Usage: python -m tools.mutate [--target 0.9] [--no-run] [MUTANT...]   (names: run only those,
e.g. the survivors a new test is for; shell patterns as ``mutmut run`` takes them)
"""

from __future__ import annotations

import argparse
import ast
import difflib
import io
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tokenize
import tomllib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ACCEPTED = Path(__file__).with_name("mutants_accepted.toml")
ROOT = Path(__file__).resolve().parent.parent
STAGE = ROOT / "build" / "mutate"
FOLDERS = ("runtime_server", "adapters", "kernel", "system")  # installed as fnkernel.<folder>
COPIED = ("tests", "proto", "notebooks", "pyproject.toml")


def stage() -> None:
    """The staged copy of the project (see the module docstring), made afresh but for mutmut's
    own state (``mutants/``): files keep their times, so that mutmut re-runs only the mutants
    of functions that changed."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.rmtree(STAGE / "src", ignore_errors=True)
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, STAGE / "src" / "fnkernel" / folder, ignore=ignore)
    for name in COPIED:
        target = STAGE / name
        if (ROOT / name).is_dir():
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(ROOT / name, target, ignore=ignore)
        else:
            shutil.copy2(ROOT / name, target)


KILLED = {"killed", "timeout", "caught by type check"}


def statuses() -> dict[str, str]:
    """mutant name → status, from ``mutmut results --all true``."""
    done = subprocess.run(
        [sys.executable, "-m", "mutmut", "results", "--all", "true"],
        capture_output=True,
        text=True,
        check=True,
        cwd=STAGE,
    )
    found = {}
    for line in done.stdout.splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep and "__mutmut_" in name:
            found[name] = status.strip()
    return found


def file_of(mutant: str) -> str:
    """``fnkernel.runtime_server.limits.x_check__mutmut_3`` → ``runtime_server/limits.py``."""
    module = mutant.partition("__mutmut_")[0].rpartition(".")[0].removeprefix("fnkernel.")
    while module and not (ROOT / (module.replace(".", "/") + ".py")).is_file():
        module = module.rpartition(".")[0]
    return module.replace(".", "/") + ".py"


@dataclass(frozen=True)
class Change:
    """What one mutant changed: the enclosing simple statement of the original, and the lines."""

    statement: str
    removed: str
    added: str
    diff: str


def change_of(mutant: str) -> Change:
    """The mutant's change, read from mutmut's mutated copy of its file."""
    import libcst
    from mutmut.mutation import diff_apply

    path = diff_apply.find_mutant(mutant).path
    functions = diff_apply.read_functions_from_index(mutant, path)
    if functions is None:
        module = diff_apply.read_mutants_module(path)
        functions = (
            diff_apply.read_original_function(module, mutant),
            diff_apply.read_mutant_function(module, mutant),
        )
    original, mutated = (libcst.Module([f]).code.splitlines() for f in functions)
    changed: set[int] = set()
    added: list[str] = []
    matcher = difflib.SequenceMatcher(a=original, b=mutated, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag != "equal":
            changed.update(range(i1, i2))
            added.extend(line.strip() for line in mutated[j1:j2])
    removed = "\n".join(original[i].strip() for i in sorted(changed))
    diff = "\n".join(difflib.unified_diff(original, mutated, n=1, lineterm=""))
    return Change(_statement(original, changed) or removed, removed, "\n".join(added), diff)


def _statement(lines: list[str], changed: set[int]) -> str:
    """The smallest simple statement of `lines` holding every changed line, as source text."""
    if not changed:
        return ""
    source = textwrap.dedent("\n".join(lines))
    try:
        tree = ast.parse(source)
    except SyntaxError:  # a hunk is not always whole statements
        return ""
    first, last = min(changed) + 1, max(changed) + 1
    holding = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.stmt)
        and not hasattr(node, "body")  # a simple statement, not an if/with/def
        and node.lineno <= first
        and last <= (node.end_lineno or node.lineno)
    ]
    if not holding:
        return ""
    best = min(holding, key=lambda node: (node.end_lineno or node.lineno) - node.lineno)
    segment = ast.get_source_segment(source, best) or ""
    return " ".join(part.strip() for part in segment.splitlines())


def prose_only(change: Change) -> bool:
    """One string literal of prose (it holds a space) changed only in case or wrapped in XX."""
    try:
        before, after = _tokens(change.removed), _tokens(change.added)
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return False
    if len(before) != len(after):
        return False
    different = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
    if len(different) != 1:
        return False
    (kind_a, old), (kind_b, new) = different[0]
    if kind_a != tokenize.STRING or kind_b != tokenize.STRING or " " not in old:
        return False
    quote = old[-1]
    inner_old, inner_new = old.strip("rbf").strip(quote), new.strip("rbf").strip(quote)
    return inner_new in (inner_old.lower(), inner_old.upper(), f"XX{inner_old}XX")


def _tokens(text: str) -> list[tuple[int, str]]:
    tokens = tokenize.generate_tokens(io.StringIO(text.replace("\n", " ") + "\n").readline)
    return [(t.type, t.string) for t in tokens if t.type not in (tokenize.NEWLINE, tokenize.NL)]


@dataclass(frozen=True)
class Rule:
    """One reason a survivor is equivalent or accepted, and the changes it covers."""

    reason: str
    kind: str  # "equivalent" or "accepted"
    function: str = ""  # a regex the mutant's name must match
    statement: str = ""  # a regex the enclosing statement must match
    added: str = ""  # a regex the mutated line(s) must match
    prose: bool = False  # only the wording of a message changed

    def covers(self, mutant: str, change: Change) -> bool:
        return (
            (not self.function or re.search(self.function, mutant) is not None)
            and (not self.statement or re.search(self.statement, change.statement) is not None)
            and (not self.added or re.search(self.added, change.added) is not None)
            and (not self.prose or prose_only(change))
        )


def rules() -> list[Rule]:
    loaded = tomllib.loads(ACCEPTED.read_text()) if ACCEPTED.is_file() else {}
    return [Rule(**rule) for rule in loaded.get("rule", [])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--no-run", action="store_true", help="only read the last run's results")
    # More children finish sooner (the tests wait on processes more than they compute), but
    # the load makes timing-bound tests fail at times, and a flaky failure reads as a kill
    # (docs/architecture.md, "Mutation testing").
    parser.add_argument("--children", type=int, default=2, help="test runs at a time")
    parser.add_argument("mutants", nargs="*", metavar="MUTANT", help="run only these")
    args = parser.parse_args(argv)
    if not args.no_run:
        stage()
        mutated = STAGE / "mutants" / "src"
        # There before mutmut starts: a PYTHONPATH entry missing at the first import is cached
        # as missing for the process's life, and mutmut's in-process test runs would then
        # import the originals.
        mutated.mkdir(parents=True, exist_ok=True)
        paths = [str(mutated), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}
        subprocess.run(
            [
                sys.executable,
                "-m",
                "mutmut",
                "run",
                "--max-children",
                str(args.children),
                *args.mutants,
            ],
            check=False,
            cwd=STAGE,
            env=env,
        )
    os.chdir(STAGE)  # mutmut reads its results and its mutated copies from there
    known = rules()
    per_file: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    explained: dict[Rule, list[str]] = defaultdict(list)
    unexplained: list[tuple[str, str, Change]] = []
    unchecked = 0
    for mutant, status in sorted(statuses().items()):
        if status == "not checked":  # the run was stopped before it got there
            unchecked += 1
            continue
        path = file_of(mutant)
        if status in KILLED:
            per_file[path]["killed"].append(mutant)
            continue
        change = change_of(mutant)
        rule = next((r for r in known if r.covers(mutant, change)), None)
        if rule is None:
            per_file[path]["counted"].append(mutant)
            unexplained.append((mutant, status, change))
        else:
            per_file[path][rule.kind].append(mutant)
            explained[rule].append(mutant)
    if unchecked:
        print(f"{unchecked} mutants not run yet: these scores are partial")
    for rule, mutants in explained.items():
        print(f"\n{rule.kind} ({len(mutants)}): {rule.reason}")
        for mutant in mutants:
            print(f"  {mutant}")
    for mutant, status, change in unexplained:
        print(f"\n{status}: {mutant}\n{textwrap.indent(change.diff, '    ')}")
    failed = False
    header = (
        f"{'file':<46}{'killed':>7}{'counted':>9}{'score':>8}{'equivalent':>12}{'accepted':>10}"
    )
    print("\n" + header)
    for path, kinds in sorted(per_file.items()):
        killed = len(kinds["killed"])
        counted = killed + len(kinds["counted"])
        score = killed / counted if counted else 1.0
        failed |= score < args.target
        print(
            f"{path:<46}{killed:>7}{counted:>9}{score:>8.1%}"
            f"{len(kinds['equivalent']):>12}{len(kinds['accepted']):>10}"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
