"""Run kpt's own end-to-end cases against fnkernel and judge them as kpt's runner does.

kpt keeps its ``fn render`` / ``fn eval`` cases in ``e2e/testdata/fn-render`` and ``fn-eval``:
a package per directory, with ``.expected/`` holding what must come out (docs/krm.md, "Measuring
against kpt"). This tool copies each case into a fresh git repository, runs the command with
``kpt`` on PATH meaning ``fnkernel`` (so a case's own ``exec.sh`` runs unchanged), and compares:

- the exit code with ``config.yaml``'s ``exitCode``;
- stderr and stdout with ``stdErr`` / ``stdErrRegEx`` / ``stdOut`` (contained, as kpt checks);
- ``results.yaml`` in the results dir with ``.expected/results.yaml``, as text;
- the package's ``git diff`` with ``.expected/diff.patch``, as text.

Each case runs twice (idempotence), like kpt's runner. A case is *not applicable* when it needs
what fnkernel does not have: a function other than its builtin ones, Docker, wasm. The cases are
not part of this repository; point the tool at a kpt checkout (``--kpt DIR``) or at a bare
mirror (``--mirror GIT_DIR``). Not part of ``make test``: ``make kpt-e2e KPT=DIR``.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML

from fnkernel.runtime_server.krm.evaluators.builtin import FUNCTIONS, bare_name

SUITES = ("e2e/testdata/fn-render", "e2e/testdata/fn-eval")
CATALOG_SUITE = "examples"  # the function catalog's examples, one package each
EXPECTED = ".expected"
# A case whose scripts use these needs a container runtime or the network.
FOREIGN_TOOLS = re.compile(r"\$\{?KRM_FN_RUNTIME|\bdocker\b|\bpodman\b|\bcurl\b|--network\b")
IMAGE_FLAG = re.compile(r"(?:--image[ =]|-i )\s*['\"]?([^\s'\"]+)")


@dataclass
class Case:
    path: Path
    name: str  # relative to the suites' parent, e.g. fn-render/basicpipeline
    config: dict[str, Any] = field(default_factory=dict)
    # The catalog's expectations predate kpt's render status: its examples are judged without it.
    without_status: bool = False

    @property
    def command(self) -> str:
        return str(self.config.get("testType") or "render")

    def expected(self, name: str) -> str:
        path = self.path / EXPECTED / name
        return path.read_text().strip() if path.is_file() else ""


def find_cases(testdata: Path, suites: tuple[str, ...] = SUITES) -> list[Case]:
    cases = []
    for suite in suites:
        top = testdata / suite
        for directory in sorted(top.rglob(EXPECTED)):
            if not directory.is_dir():
                continue
            case = Case(directory.parent, str(directory.parent.relative_to(top.parent)))
            config = directory / "config.yaml"
            if config.is_file():
                case.config = YAML(typ="safe").load(config.read_text()) or {}
            cases.append(case)
    return cases


def images_of(case: Case) -> set[str]:
    """Every function image the case refers to: in its Kptfiles, its config, its scripts."""
    images: set[str] = set()
    if case.config.get("image"):
        images.add(str(case.config["image"]))
    for path in case.path.rglob("*"):
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        if path.name == "Kptfile":
            try:
                documents = list(YAML(typ="safe").load_all(text))
            except Exception:  # an invalid Kptfile is a case of its own
                continue
            for document in documents:
                pipeline = document.get("pipeline") if isinstance(document, dict) else None
                for stage in ("mutators", "validators"):
                    for step in (pipeline or {}).get(stage) or []:
                        if isinstance(step, dict) and step.get("image"):
                            images.add(str(step["image"]))
        elif path.suffix == ".sh" and EXPECTED in path.parts:
            images.update(IMAGE_FLAG.findall(text))
    return images


def not_applicable(case: Case) -> str:
    """Why fnkernel cannot run the case, or "" when it can."""
    config = case.config
    if config.get("skip"):
        return "skipped by kpt"
    if config.get("allowWasm"):
        return "wasm"
    if config.get("runtimes"):
        return f"runtime {config['runtimes']}"
    for script in (case.path / EXPECTED).glob("*.sh"):
        if FOREIGN_TOOLS.search(script.read_text()):
            return f"{script.name} uses a container runtime or the network"
    for image in sorted(images_of(case)):
        name = bare_name(image).split(":")[0]
        if name not in FUNCTIONS:  # an image we do not have (kpt's cases expect Docker's words)
            return f"image {image}"
    return ""


def _git(directory: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=directory, capture_output=True, text=True, check=True)
    return done.stdout


def _commit(directory: Path, message: str) -> None:
    _git(directory, "add", "--all")
    _git(
        directory,
        "-c",
        "user.name=none",
        "-c",
        "user.email=none",
        "commit",
        "--quiet",
        "--allow-empty",
        "-m",
        message,
    )


def kpt_argv(case: Case, package: Path, results: Path | None, out: Path | None) -> list[str]:
    """The kpt command line kpt's runner would use for a case with no exec.sh."""
    config = case.config
    argv = ["kpt", "fn", case.command, str(package)]
    if results is not None:
        argv += ["--results-dir", str(results)]
    if out is not None:
        argv += ["-o", str(out)]
    if config.get("imagePullPolicy"):
        argv += ["--image-pull-policy", str(config["imagePullPolicy"])]
    if case.command == "render":
        if config.get("allowExec"):
            argv.append("--allow-exec")
        if config.get("disableOutputTruncate"):
            argv.append("--truncate-output=false")
        return argv
    if config.get("network"):
        argv.append("--network")
    if config.get("image"):
        argv += ["--image", str(config["image"])]
    elif config.get("execPath"):
        argv += ["--exec", str((case.path / EXPECTED / config["execPath"]).resolve())]
    if config.get("tag"):
        argv += ["--tag", str(config["tag"])]
    if config.get("fnConfig"):
        argv += ["--fn-config", str((case.path / EXPECTED / config["fnConfig"]).resolve())]
    if config.get("includeMetaResources"):
        argv.append("--include-meta-resources")
    if config.get("args"):
        argv.append("--")
        argv += [f"{key}={value}" for key, value in config["args"].items()]
    return argv


def _timings_zeroed(stderr: str) -> str:
    """``[PASS] "IMAGE" in 1.2s`` → ``in 0s``, as kpt's runner does before comparing."""
    lines = []
    for line in stderr.split("\n"):
        tokens = line.split()
        if line.startswith(("[PASS]", "[FAIL]")) and len(tokens) == 4 and tokens[2] == "in":
            line = " ".join([*tokens[:3], "0s"])
        lines.append(line)
    return "\n".join(lines)


def _strip(text: str, lines: list[str]) -> str:
    """kpt's runner removes each such line (with its newline) wherever it occurs."""
    for line in lines:
        text = text.replace(line + "\n", "")
    return text


def run_once(case: Case, shims: Path, scratch: Path, e2e: Path) -> str:
    """Run the case once in `scratch`; "" when kpt would be satisfied, else why not."""
    config = case.config
    package = scratch / case.path.name
    shutil.copytree(case.path, package, symlinks=True)
    _git(package, "init", "--quiet")
    _commit(package, "first")
    first = _git(package, "log", "-n", "1", "--pretty=format:%h").strip()
    results = scratch / "results" if (case.path / EXPECTED / "results.yaml").is_file() else None
    out = package / "out" if (case.path / "out").is_dir() else None
    env = dict(os.environ, PATH=f"{shims}{os.pathsep}{os.environ['PATH']}")
    env.update({str(k): str(v) for k, v in (config.get("env") or {}).items()})
    setup = case.path / EXPECTED / "setup.sh"
    if setup.is_file():
        subprocess.run(["bash", str(setup)], cwd=package, env=env, check=False)
    exec_script = case.path / EXPECTED / "exec.sh"
    if exec_script.is_file():
        argv, cwd = ["bash", str(exec_script)], package
    else:
        # kpt's runner runs kpt from its e2e directory: Kptfile `exec:` paths are relative to it
        argv, cwd = kpt_argv(case, package, results, out), e2e
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    stderr = _strip(_timings_zeroed(done.stderr), config.get("stdErrStripLines") or [])
    stderr = re.sub(r"/?\w+/kpt-pipeline-e2e-\d+/", "", stderr.replace(f"{scratch}/", ""))
    if done.returncode != int(config.get("exitCode") or 0):
        return f"exit {done.returncode}, want {config.get('exitCode') or 0}\n{done.stderr}"
    if str(config.get("stdErr") or "") not in stderr:
        return f"stderr lacks {config.get('stdErr')!r}\n--- stderr:\n{stderr}"
    if config.get("stdErrRegEx") and not re.search(str(config["stdErrRegEx"]), stderr):
        return f"stderr does not match {config['stdErrRegEx']!r}\n--- stderr:\n{stderr}"
    if str(config.get("stdOut") or "") not in done.stdout:
        return f"stdout lacks {config.get('stdOut')!r}\n--- stdout:\n{done.stdout}"
    actual_results = ""
    if results is not None and results.is_dir():
        files = sorted(results.iterdir())
        if len(files) > 1:
            return f"{len(files)} files in the results dir"
        if files:
            actual_results = _strip(
                files[0].read_text().strip(), config.get("actualStripLines") or []
            )
    if actual_results != case.expected("results.yaml"):
        return _differs("results", case.expected("results.yaml"), actual_results)
    if case.without_status and (package / "Kptfile").is_file():
        # Writing the status also writes the Kptfile in kpt's layout (maps sorted): where that
        # is all that changed, the Kptfile is judged as it was.
        kptfile = package / "Kptfile"
        text = re.sub(r"(?ms)^status:\n(?:[ \t].*?\n|\n)*\Z", "", kptfile.read_text())
        original = _git(package, "show", f"{first}:Kptfile")
        same = list(YAML(typ="safe").load_all(text)) == list(YAML(typ="safe").load_all(original))
        kptfile.write_text(original if same else text)
    _commit(package, "second")
    actual_diff = _git(package, "diff", first, "HEAD").strip()
    expected_diff = case.expected("diff.patch")
    if config.get("diffStripRegEx"):
        actual_diff, expected_diff = (
            _normalized(text, str(config["diffStripRegEx"]))
            for text in (actual_diff, expected_diff)
        )
    if actual_diff != expected_diff:
        return _differs("diff", expected_diff, actual_diff) + f"\n--- stderr:\n{done.stderr}"
    return "" if done.returncode == 0 else "stop"


def _normalized(diff: str, strip: str) -> str:
    """As kpt's runner compares diffs with diffStripRegEx: matching lines dropped, index and
    hunk headers normalized."""
    pattern = re.compile(strip)
    lines = []
    for line in diff.split("\n"):
        if pattern.search(line):
            continue
        line = re.sub(r"^index [0-9a-f]+\.\.[0-9a-f]+", "index NORMALIZED", line)
        line = re.sub(r"^@@ -\d+,\d+ \+\d+,\d+ @@", "@@ NORMALIZED @@", line)
        lines.append(line)
    return "\n".join(lines)


def _differs(what: str, expected: str, actual: str) -> str:
    lines = difflib.unified_diff(
        expected.splitlines(), actual.splitlines(), "expected", "actual", lineterm=""
    )
    return f"{what} differs:\n" + "\n".join(lines)


def run_case(case: Case, shims: Path, e2e: Path) -> str:
    """Twice, each in a fresh copy, as kpt's runner does; a failing command runs once."""
    for _ in range(2):
        with tempfile.TemporaryDirectory(prefix="kpt-pipeline-e2e-") as scratch:
            why = run_once(case, shims, Path(scratch), e2e)
        if why == "stop":
            return ""
        if why:
            return why
    return ""


def _extract(mirror: str, commit: str, paths: tuple[str, ...], scratch: Path) -> Path:
    """`paths` of a bare repository at `commit`, written out under `scratch`."""
    archive = subprocess.run(
        ["git", "--git-dir", mirror, "archive", commit, *paths], capture_output=True, check=True
    )
    scratch.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(scratch)], input=archive.stdout, check=True)
    return scratch


def catalog_cases(root: Path) -> list[Case]:
    """The catalog's examples of our builtin functions (``examples/NAME-*``)."""
    cases = [
        case
        for case in find_cases(root, (CATALOG_SUITE,))
        if any(case.path.name.startswith(f"{name}-") for name in FUNCTIONS)
    ]
    for case in cases:
        case.without_status = True
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--kpt", metavar="DIR", help="a kpt checkout")
    source.add_argument("--mirror", metavar="GIT_DIR", help="a bare kpt repository")
    parser.add_argument("--commit", default="HEAD", help="with --mirror (default HEAD)")
    parser.add_argument(
        "--catalog", metavar="GIT_DIR", help="also the function catalog's examples (a bare clone)"
    )
    parser.add_argument("--only", metavar="SUBSTRING", help="run only cases whose name has it")
    parser.add_argument("-v", "--verbose", action="store_true", help="print why each case fails")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fnkernel-kpt-e2e-") as scratch:
        shims = Path(scratch) / "bin"
        shims.mkdir()
        kpt = shims / "kpt"
        kpt.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m fnkernel.runtime_server.cli "$@"\n')
        kpt.chmod(0o755)
        suites: list[tuple[str, list[Case], Path]] = []
        if args.kpt or args.mirror:
            testdata = (
                Path(args.kpt)
                if args.kpt
                else _extract(args.mirror, args.commit, SUITES, Path(scratch) / "kpt")
            )
            suites.append(("kpt", find_cases(testdata), testdata / "e2e"))
        if args.catalog:
            listed = subprocess.run(
                ["git", "--git-dir", args.catalog, "ls-tree", "--name-only", "HEAD", "examples/"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()
            ours = tuple(
                path
                for path in listed
                if any(path.removeprefix("examples/").startswith(f"{n}-") for n in FUNCTIONS)
            )
            catalog = _extract(args.catalog, "HEAD", ours, Path(scratch) / "catalog")
            suites.append(("catalog", catalog_cases(catalog), catalog / CATALOG_SUITE))
        if not suites:
            parser.error("give --kpt, --mirror or --catalog")
        summary = []
        differ = 0
        for label, cases, workdir in suites:
            counts = {"agree": 0, "differ": 0, "n/a": 0}
            for case in cases:
                if args.only and args.only not in case.name:
                    continue
                reason = not_applicable(case)
                if reason:
                    counts["n/a"] += 1
                    print(f"n/a     {label}: {case.name}: {reason}")
                    continue
                why = run_case(case, shims, workdir)
                counts["agree" if not why else "differ"] += 1
                print(f"{'agree' if not why else 'DIFFER':<7} {label}: {case.name}")
                if why and args.verbose:
                    print("    " + why.replace("\n", "\n    "))
            applicable = counts["agree"] + counts["differ"]
            summary.append(
                f"{label}: {counts['agree']} of {applicable} applicable cases agree with kpt "
                f"({counts['n/a']} not applicable)"
            )
            differ += counts["differ"]
        print("\n" + "\n".join(summary))
    return 0 if differ == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
