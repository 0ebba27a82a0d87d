"""kpt's own command line, as fnkernel serves it (docs/krm.md, "CLI"): ``fnkernel fn render``,
``fn eval``, ``fn source``, ``fn sink`` and ``pkg init``, with kpt's flags, progress lines,
results and exit codes — the same pipeline as ``fnkernel render`` and ``eval`` (``cli/krm.py``),
behind kpt's front end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fnkernel.runtime_server.cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    UsageError,
    add_bound_flags,
    add_chain_flags,
    bounds_from_flags,
    chain_from_flags,
    results_dir,
)

if TYPE_CHECKING:  # loaded when a KRM command runs: they load ruamel.yaml
    from fnkernel.runtime_server.krm.pipeline import Step
    from fnkernel.runtime_server.krm.resources.package import Package


def go_duration(seconds: float) -> str:
    """A duration as Go prints a ``time.Duration`` truncated to milliseconds: 0s, 12ms, 1.5s."""
    millis = int(seconds * 1000)
    if millis == 0:
        return "0s"
    if millis < 1000:
        return f"{millis}ms"
    return f"{millis / 1000:.3f}".rstrip("0").rstrip(".") + "s"


class KptReport:
    """kpt's progress on stderr: a ``Package "NAME":`` line per package, ``[RUNNING]`` and
    ``[PASS]``/``[FAIL]`` per function with its results and stderr (docs/krm.md, "CLI")."""

    def __init__(self, top: Path | None = None, results_dir: str | None = None) -> None:
        self.top = top
        self.package_name = ""
        self.packages = 0
        self.out = sys.stderr
        self.results_dir = results_dir
        self.blank_pending = False  # kpt ends each package whose pipeline ran with a blank line

    def _end_package(self) -> None:
        if self.blank_pending:
            print("", file=self.out)
            self.blank_pending = False

    def package(self, package: Package) -> None:
        self._end_package()
        self.packages += 1
        name = Path(package.root).resolve().name
        self.package_name = (
            f"{Path(self.top).resolve().name}/{package.relative.rstrip('/')}"
            if (package.relative and self.top is not None)
            else name
        )
        print(f'Package "{self.package_name}":', file=self.out)

    def step(self, step: Step) -> None:
        from fnkernel.runtime_server.krm.pipeline import EXEC_NOT_ALLOWED
        from fnkernel.runtime_server.krm.resources.resourcelist import format_result

        self.blank_pending = bool(self.package_name) and step.ok
        if step.execution_error == EXEC_NOT_ALLOWED:
            return  # kpt refuses it before running anything
        name = step.name
        running = f"[RUNNING] {json.dumps(name)}"
        if step.selective:
            running += f" on {step.inputs} resource(s)"
        if self.package_name:
            running += f" on package {json.dumps(self.package_name)}"
        print(running, file=self.out)
        verdict = "PASS" if step.ok else "FAIL"
        print(f"[{verdict}] {json.dumps(name)} in {go_duration(step.duration)}", file=self.out)
        if step.results:
            print("  [Results]:", file=self.out)
            for result in step.results:
                print(f"    {format_result(result)}", file=self.out)
        stderr = step.stderr if step.ran else ""
        if stderr:
            print("  Stderr:", file=self.out)
            for line in stderr.split("\n"):
                print(f"    {line.strip()}", file=self.out)
        if not step.ok and step.ran:
            print(f"  Exit code: {step.exit_code}", file=self.out)

    def finish(self, steps: list[Step], *, summary: bool, failed: bool = False) -> None:
        """The end of a render: kpt's summary line (in place only; after a failure only when
        what succeeded was saved), then where results.yaml went."""
        self._end_package()
        ran = sum(1 for s in steps if s.ok)
        if summary and not failed:
            line = f"Successfully executed {ran} function(s) in {self.packages} package(s)."
        elif summary and ran:
            line = f"Partially executed {ran} function(s) in {self.packages} package(s)."
        elif summary:
            line = f"Failed to execute any functions in {self.packages} package(s)."
        if summary:
            print(line, file=self.out)
        self.results()

    def results(self) -> None:
        if self.results_dir:
            path = os.path.join(self.results_dir, "results.yaml")
            print(f"For complete results, see {path}", file=self.out)


def _kpt_error(exc: Exception, prefix: str = "Error") -> int:
    """kpt's last word on a failure ("Error: why"; fn eval says "error: why"); nothing more
    after a function's own failure, which its output has shown."""
    from fnkernel.runtime_server.krm.pipeline import PipelineError

    if not (isinstance(exc, PipelineError) and exc.handled):
        text = str(exc)
        print(text if text.startswith("Error:") else f"{prefix}: {text}", file=sys.stderr)
    return EXIT_FAILURE


def _taken(output: str | None) -> bool:
    """``-o DIR`` must name a new directory (kpt's rule); says so if it does not."""
    if output in (None, "", "stdout", "unwrap") or not Path(str(output)).exists():
        return False
    print(
        f'directory "{output}" already exists, please delete the directory and retry',
        file=sys.stderr,
    )
    return True


def _write_output(items: list[Any], output: str) -> int:
    """``-o``: a ResourceList on stdout (``stdout``), the bare resources (``unwrap``), or the
    package's files in a new directory."""
    from fnkernel.runtime_server.krm.resources.package import (
        render_files,
        resource_list_text,
        unwrapped,
    )

    if output == "stdout":
        sys.stdout.write(resource_list_text(items))
    elif output == "unwrap":
        sys.stdout.write(unwrapped(items))
    elif _taken(output):
        return EXIT_FAILURE
    else:
        for path, text in render_files(items, tidy=True).items():
            target = Path(output) / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
    return EXIT_OK


def _fn_render(args: argparse.Namespace) -> int:
    from fnkernel.runtime_server.krm.pipeline import PipelineError, render
    from fnkernel.runtime_server.krm.resources.package import PackageError

    root = _package_argument(args.dir)
    if _taken(args.output):
        return EXIT_FAILURE
    report = KptReport(root, args.results_dir)
    chain = chain_from_flags(args, "render")
    try:
        outcome = render(
            root,
            chain.evaluator(),
            allow_exec=args.allow_exec,
            dry_run=args.dry_run,
            results_dir=Path(args.results_dir) if args.results_dir else None,
            progress=report.step,
            on_package=report.package,
            diffs=False,
            in_place=not args.output,
            bounds=bounds_from_flags(args),
        )
    except PipelineError as exc:
        report.finish(exc.steps, summary=exc.saved, failed=True)
        return _kpt_error(exc)
    except (PackageError, FileNotFoundError, ValueError) as exc:
        return _kpt_error(exc)
    finally:
        chain.close()
    report.finish(outcome.steps, summary=not args.output)
    if args.output:
        return _write_output(outcome.items, args.output)
    return EXIT_OK


def _package_argument(directory: str) -> Path:
    """The package a command names; a symlink is resolved, with kpt's warning."""
    path = Path(directory)
    if path.is_symlink():
        resolved = os.path.relpath(path.resolve())
        print(
            f"[WARN] resolved symlink {json.dumps(directory)} to {json.dumps(resolved)}, please "
            "note that the symlinks within the package are ignored",
            file=sys.stderr,
        )
        return Path(resolved)
    return path


def fn_config(path: str) -> Any:
    """``--fn-config``: one KRM object, as kpt reads it."""
    from fnkernel.runtime_server.krm.resources.package import not_krm, read_documents

    text = Path(path).read_text()
    documents = read_documents(text, path)
    if len(documents) > 1:
        raise UsageError(f"must not contain more than one config, got {len(documents)}")
    if not documents or not isinstance(documents[0], dict):
        contents = f"{documents[0]}\n" if documents else ""
        raise UsageError(
            f"wrong node kind: expected MappingNode but got ScalarNode: node contents:\n{contents}"
        )
    why = not_krm(documents[0], path)
    if why:
        raise UsageError(why)
    return documents[0]


def _selectors(args: argparse.Namespace, prefix: str) -> list[dict[str, Any]]:
    selector: dict[str, Any] = {}
    for flag, key in (
        ("api_version", "apiVersion"),
        ("kind", "kind"),
        ("name", "name"),
        ("namespace", "namespace"),
    ):
        value = getattr(args, f"{prefix}_{flag}")
        if value:
            selector[key] = value
    for flag in ("labels", "annotations"):
        pairs = getattr(args, f"{prefix}_{flag}")
        if pairs:
            selector[flag] = dict(pair.split("=", 1) for pair in pairs)
    return [selector] if selector else []


def _fn_eval(args: argparse.Namespace) -> int:
    from fnkernel.runtime_server.client import parse_pairs
    from fnkernel.runtime_server.krm.pipeline import (
        PipelineError,
        PipelineFunction,
        config_map,
        evaluate_one,
        save_function,
    )
    from fnkernel.runtime_server.krm.resources.package import PackageError, resource_list_items
    from fnkernel.runtime_server.krm.resources.resourcelist import InvalidResourceList

    if args.save and not args.type:
        return _kpt_error(
            UsageError("--type must be specified if saving functions to Kptfile (--save=true)")
        )
    if bool(args.image) == bool(args.exec_command):
        raise UsageError("must specify exactly one of --image and --exec")
    try:
        data = parse_pairs(args.pairs)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    function = PipelineFunction(
        image=args.image or "",
        command="" if args.image else args.exec_command,
        tag=args.tag if args.image else "",
        selectors=tuple(_selectors(args, "match")),
        exclude=tuple(_selectors(args, "exclude")),
    )
    from_stdin = args.dir == "-"
    if args.include_meta_resources:
        return _kpt_error(
            UsageError(
                "--include-meta-resources is no longer necessary because meta resources are now "
                "included by default"
            )
        )
    if _taken(args.output):
        return EXIT_FAILURE
    report = KptReport(results_dir=args.results_dir)
    chain = chain_from_flags(args, "eval")
    try:
        # kpt gives the function a ConfigMap named function-input, empty without `-- k=v`
        config = fn_config(args.fn_config) if args.fn_config else config_map(data)
        items = None
        if from_stdin:
            items = resource_list_items(sys.stdin.read())
        outcome = evaluate_one(
            None if from_stdin else _package_argument(args.dir),
            function,
            chain.evaluator(),
            config=config,
            data=data,
            dry_run=args.dry_run or bool(args.output),
            progress=report.step,
            include_meta=True,
            bounds=bounds_from_flags(args),
            items=items,
            results_dir=Path(args.results_dir) if args.results_dir else None,
            config_file=Path(args.fn_config) if args.fn_config else None,
        )
    except PipelineError as exc:
        report.results()
        return _kpt_error(exc, "error")
    except (PackageError, UsageError, InvalidResourceList, OSError) as exc:
        return _kpt_error(exc, "error")
    finally:
        chain.close()
    report.results()
    if args.output:
        return _write_output(outcome.items, args.output)
    if from_stdin:
        return _write_output(outcome.items, "stdout")
    if args.save:
        config_path = Path(args.fn_config) if args.fn_config else None
        print(
            save_function(Path(args.dir), function, args.type, config_path, data), file=sys.stderr
        )
    return EXIT_OK


def _fn_source(args: argparse.Namespace) -> int:
    """``kpt fn source DIR``: the package's resources as a ResourceList on stdout."""
    from fnkernel.runtime_server.krm.resources.package import PackageError, load_package

    try:
        package = load_package(Path(args.dir), require_kptfile=False)
    except (PackageError, FileNotFoundError) as exc:
        return _kpt_error(exc)
    return _write_output(package.all_resources(meta=True), "stdout")


def _fn_sink(args: argparse.Namespace) -> int:
    """``kpt fn sink DIR``: a ResourceList from stdin written out as files in DIR."""
    from fnkernel.runtime_server.krm.resources.package import resource_list_items

    return _write_output(resource_list_items(sys.stdin.read()), args.dir)


def add_fn_group(commands: Any) -> None:
    """``fnkernel fn render|eval|source|sink``: kpt's own commands and flags, so that kpt's
    scripts run unchanged (docs/krm.md, "CLI")."""
    fn = commands.add_parser(
        "fn", help="kpt's fn commands: render, eval, source, sink (same flags as kpt)"
    )
    group = fn.add_subparsers(dest="fn_command", metavar="COMMAND", required=True)

    render = group.add_parser("render", help="run a package's Kptfile pipeline (kpt fn render)")
    render.add_argument("dir", metavar="DIR", nargs="?", default=".")
    render.add_argument("--allow-exec", action="store_true", help="allow `exec` pipeline steps")
    render.add_argument(
        "--results-dir", metavar="D", type=results_dir, help="write results.yaml there"
    )
    render.add_argument(
        "-o", "--output", metavar="stdout|unwrap|DIR", help="send the output elsewhere"
    )
    render.add_argument("--dry-run", action="store_true", help="run, but write no file")
    _add_accepted(render, "--allow-network", "--allow-alpha-wasm")
    render.add_argument("--image-pull-policy", help=argparse.SUPPRESS)
    render.add_argument("--truncate-output", help=argparse.SUPPRESS)
    add_chain_flags(render)
    add_bound_flags(render)
    render.set_defaults(func=_fn_render)

    evaluate = group.add_parser("eval", help="run one function over a package (kpt fn eval)")
    evaluate.add_argument("dir", metavar="DIR|-", nargs="?", default=".")
    evaluate.add_argument("-i", "--image", help="the function's image")
    evaluate.add_argument("--exec", dest="exec_command", metavar="CMD", help="a local program")
    evaluate.add_argument("--fn-config", metavar="F", help="the function config (one KRM object)")
    evaluate.add_argument(
        "--results-dir", metavar="D", type=results_dir, help="write results.yaml there"
    )
    evaluate.add_argument("-o", "--output", metavar="stdout|unwrap|DIR")
    evaluate.add_argument(
        "-m",
        "--include-meta-resources",
        action="store_true",
        help="kpt's old flag: refused, the Kptfiles are always given",
    )
    evaluate.add_argument("--dry-run", action="store_true", help="run, but write no file")
    evaluate.add_argument(
        "-s", "--save", action="store_true", help="add the function to the Kptfile's pipeline"
    )
    evaluate.add_argument(
        "-t", "--type", choices=("mutator", "validator"), help="with --save: where it goes"
    )
    for prefix in ("match", "exclude"):
        for flag in ("api-version", "kind", "name", "namespace"):
            evaluate.add_argument(f"--{prefix}-{flag}", metavar="VALUE")
        for flag in ("labels", "annotations"):
            evaluate.add_argument(f"--{prefix}-{flag}", metavar="K=V", action="append")
    _add_accepted(evaluate, "--network", "--as-current-user", "--allow-alpha-wasm")
    evaluate.add_argument(
        "--tag", default="", help="with --image: a version or semver constraint (docs/krm.md)"
    )
    evaluate.add_argument(
        "--mount",
        action="append",
        metavar="type=bind,src=HOST,dst=PATH",
        help="a builtin function reads PATH from HOST, as kpt's container would (docs/krm.md)",
    )
    for flag in ("--image-pull-policy", "-e", "--env"):
        evaluate.add_argument(flag, action="append", help=argparse.SUPPRESS)
    add_chain_flags(evaluate)
    add_bound_flags(evaluate)
    evaluate.set_defaults(func=_fn_eval, pairs=[])

    source = group.add_parser("source", help="print a package as a ResourceList (kpt fn source)")
    source.add_argument("dir", metavar="DIR", nargs="?", default=".")
    source.set_defaults(func=_fn_source)
    sink = group.add_parser("sink", help="write a ResourceList from stdin as files (kpt fn sink)")
    sink.add_argument("dir", metavar="DIR")
    sink.set_defaults(func=_fn_sink)


# kpt pkg init's package context: a ConfigMap set-namespace reads the package name from.
PACKAGE_CONTEXT = """\
apiVersion: v1
kind: ConfigMap
metadata:
  name: kptfile.kpt.dev
  annotations:
    config.kubernetes.io/local-config: "true"
data:
  name: example
"""


def _pkg_init(args: argparse.Namespace) -> int:
    """``kpt pkg init [DIR]``: the files a package needs, each only if it is missing."""
    from fnkernel.runtime_server.krm.resources import kptfile

    root = Path(args.dir)
    name = root.resolve().name
    if not root.is_dir():
        print(f"creating package directory {args.dir}", file=sys.stderr)
        root.mkdir(parents=True)
    document = {
        "apiVersion": kptfile.API_VERSION,
        "kind": kptfile.KIND,
        "metadata": {"name": name, "annotations": {"config.kubernetes.io/local-config": "true"}},
        "info": {"description": args.description},
    }
    files = {
        "Kptfile": lambda: kptfile.canonical_text(document),
        "README.md": lambda: f"# {name}\n\n## Description\n{args.description}\n",
        "package-context.yaml": lambda: PACKAGE_CONTEXT,
    }
    for file_name, text in files.items():
        if not (root / file_name).exists():
            print(f"writing {os.path.join(args.dir, file_name)}", file=sys.stderr)
            (root / file_name).write_text(text())
    return EXIT_OK


def add_pkg_group(commands: Any) -> None:
    pkg = commands.add_parser("pkg", help="kpt's pkg init (the rest of kpt pkg is not here)")
    group = pkg.add_subparsers(dest="pkg_command", metavar="COMMAND", required=True)
    init = group.add_parser(
        "init", help="add a Kptfile, README.md and package context (kpt pkg init)"
    )
    init.add_argument("dir", metavar="DIR", nargs="?", default=".")
    init.add_argument("--description", default="sample description")
    init.set_defaults(func=_pkg_init)


def _add_accepted(parser: argparse.ArgumentParser, *flags: str) -> None:
    """kpt flags that change nothing here (no containers, no network to allow)."""
    for flag in flags:
        parser.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
