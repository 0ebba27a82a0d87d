"""Mutation testing of the Runtime Server's core: the score per file (docs/architecture.md,
"Mutation testing").

Runs ``mutmut run`` (configured in pyproject.toml: the files it mutates and the tests that
drive them), then reads every mutant's status and prints, per file, how many of its mutants
the tests killed, leaving out those listed in ``tools/mutants_accepted.toml`` as equivalent
(a change of no behaviour) or accepted (with the reason). The surviving ones that are not
listed are printed: each is a test to write, or a line to add to that list with its reason.
Exit status 1 when a file scores under the target.

Usage: python -m tools.mutate [--target 0.9] [--no-run]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

ACCEPTED = Path(__file__).with_name("mutants_accepted.toml")
KILLED = {"killed", "timeout", "caught by type check"}


def statuses() -> dict[str, str]:
    """mutant name → status, from ``mutmut results --all true``."""
    done = subprocess.run(
        [sys.executable, "-m", "mutmut", "results", "--all", "true"],
        capture_output=True,
        text=True,
        check=True,
    )
    found = {}
    for line in done.stdout.splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep and "__mutmut_" in name:
            found[name] = status.strip()
    return found


def file_of(mutant: str) -> str:
    """``runtime_server.limits.x_check__mutmut_3`` → ``runtime_server/limits.py``."""
    module = mutant.partition("__mutmut_")[0].rpartition(".")[0]
    while module and not Path(module.replace(".", "/") + ".py").is_file():
        module = module.rpartition(".")[0]
    return module.replace(".", "/") + ".py"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--no-run", action="store_true", help="only read the last run's results")
    args = parser.parse_args(argv)
    if not args.no_run:
        subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", "2"], check=False)
    accepted = tomllib.loads(ACCEPTED.read_text()) if ACCEPTED.is_file() else {}
    per_file: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    unchecked = 0
    for mutant, status in statuses().items():
        if status == "not checked":  # the run was stopped before it got there
            unchecked += 1
            continue
        kind = "killed" if status in KILLED else "accepted" if mutant in accepted else status
        per_file[file_of(mutant)][kind].append(mutant)
    if unchecked:
        print(f"{unchecked} mutants not run yet: these scores are partial")
    failed = False
    print(f"{'file':<48}{'killed':>8}{'counted':>9}{'score':>8}{'accepted':>10}")
    for path, kinds in sorted(per_file.items()):
        killed = len(kinds["killed"])
        counted = sum(len(v) for k, v in kinds.items() if k != "accepted")
        score = killed / counted if counted else 1.0
        failed |= score < args.target
        print(f"{path:<48}{killed:>8}{counted:>9}{score:>8.1%}{len(kinds['accepted']):>10}")
    for _, kinds in sorted(per_file.items()):
        for kind, mutants in sorted(kinds.items()):
            if kind in ("killed", "accepted"):
                continue
            for mutant in sorted(mutants):
                print(f"  {kind}: {mutant}   (mutmut show {mutant})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
