"""KRM pipelines: ``render`` and ``eval`` (kpt's ``fn render`` and ``fn eval``, whose own
command line, flags and output are ``cli/kpt.py``'s), ``export``, and the servers of KRM
functions: ``evaluator`` (the chain) and ``wrapper-server`` (one function's pod)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fnkernel.runtime_server.cli import kpt
from fnkernel.runtime_server.cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    add_bound_flags,
    add_chain_flags,
    add_client_flags,
    bounds_from_flags,
    chain_from_flags,
    client_of,
    count,
    listen_address,
    port,
    results_dir,
)

if TYPE_CHECKING:  # loaded when a KRM command runs: they load ruamel.yaml
    from fnkernel.runtime_server.krm.pipeline import Outcome, Step


_SHOWN_RESULTS = 5  # of a failed step's results, under its line


def _step_line(step: Step, number: int) -> str:
    from fnkernel.runtime_server.krm.resources.resourcelist import format_result

    mark = "ok" if step.ok else "FAILED"
    where = f"{step.package}: " if step.package else ""
    line = f"[{number}] {where}{step.stage} {step.function} ({step.evaluator or '-'}) "
    line += f"{step.duration * 1000:.0f} ms {mark}"
    if step.tally:  # as the notebook's view says it
        line += f" ({step.tally})"
    if step.error and not step.error_in_results:
        line += f"\n    {step.error}"
    line += "".join(f"\n    stderr: {text}" for text in step.said)  # a starlark print, say
    if not step.ok:  # what the function said of its failure (kpt prints its results too)
        for result in step.results[:_SHOWN_RESULTS]:  # as kpt prints them (docs/krm.md)
            line += f"\n    {format_result(result)}"
        if len(step.results) > _SHOWN_RESULTS:
            more = len(step.results) - _SHOWN_RESULTS
            line += f"\n    … {more} more (--output json, or kpt's fn eval --results-dir)"
    return line


def _report(outcome: Outcome, output: str, dry_run: bool) -> None:
    """The steps and the files changed — with `dry_run`, the files that would be."""
    if output == "json":
        _json_report(outcome.steps, dry_run, written=outcome.written, removed=outcome.removed)
        return
    changed = outcome.written + [f"{path} (removed)" for path in outcome.removed]
    files = ", ".join(changed) or "none"
    said = (
        f"dry run, nothing written; would change: {files}" if dry_run else f"files changed: {files}"
    )
    print(f"{len(outcome.steps)} step(s); {said}")


def _json_report(
    steps: list[Step],
    dry_run: bool,
    *,
    written: list[str] | None = None,
    removed: list[str] | None = None,
    error: str = "",
) -> None:
    """``--output json``: every step run, the files changed, and the failure ("" for none) —
    a failed render's too, so that a script reads why from the same document."""
    steps_json = [
        {
            "package": s.package,
            "stage": s.stage,
            "function": s.function,
            "evaluator": s.evaluator,
            "durationMs": round(s.duration * 1000, 1),
            "results": s.results,
            "error": s.error,
            "stderr": s.stderr,
        }
        for s in steps
    ]
    report = {
        "steps": steps_json,
        "written": written or [],
        "removed": removed or [],
        "dryRun": dry_run,
        "error": error,
    }
    print(json.dumps(report, indent=2, default=str))


def _render(args: argparse.Namespace) -> int:
    from fnkernel.runtime_server.krm.pipeline import PipelineError, render
    from fnkernel.runtime_server.krm.resources.package import PackageError
    from fnkernel.runtime_server.krm.resources.resourcelist import InvalidResourceList

    counter = iter(range(1, 10_000))
    chain = chain_from_flags(args, "render")
    try:
        outcome = render(
            Path(args.dir),
            chain.evaluator(),
            allow_exec=args.allow_exec,
            dry_run=args.dry_run,
            results_dir=Path(args.results_dir) if args.results_dir else None,
            progress=lambda step: print(_step_line(step, next(counter)), file=sys.stderr),
            diffs=False,  # a progress line per step; the files themselves show the change
            bounds=bounds_from_flags(args),
        )
    except PipelineError as exc:
        print(f"fnkernel render: {exc} (the Kptfile's status records it)", file=sys.stderr)
        if args.output == "json":
            _json_report(exc.steps, args.dry_run, error=str(exc))
        return EXIT_FAILURE
    except PackageError as exc:
        print(f"fnkernel render: {exc}; no file was changed", file=sys.stderr)
        return EXIT_FAILURE
    except (FileNotFoundError, InvalidResourceList) as exc:
        print(f"fnkernel render: {exc}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        chain.close()
    _report(outcome, args.output, args.dry_run)
    return EXIT_OK


def _eval(args: argparse.Namespace) -> int:
    from fnkernel.runtime_server.client import parse_pairs
    from fnkernel.runtime_server.krm.pipeline import PipelineError, PipelineFunction, evaluate_one
    from fnkernel.runtime_server.krm.resources.package import PackageError
    from fnkernel.runtime_server.krm.resources.resourcelist import InvalidResourceList

    try:
        data = parse_pairs(args.pairs)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    chain = chain_from_flags(args, "eval")
    try:
        config = kpt.fn_config(args.fn_config) if args.fn_config else None
        outcome = evaluate_one(
            Path(args.dir),
            PipelineFunction(image=args.image),
            chain.evaluator(),
            config=config,
            data=data,
            dry_run=args.dry_run,
            progress=lambda step: print(_step_line(step, 1), file=sys.stderr),
            include_meta=True,  # the Kptfiles among the resources, as `fn eval` (kpt) has them
            bounds=bounds_from_flags(args),
        )
    except (PipelineError, PackageError) as exc:
        print(f"fnkernel eval: {exc}; no file was changed", file=sys.stderr)
        if args.output == "json":
            _json_report(
                exc.steps if isinstance(exc, PipelineError) else [], args.dry_run, error=str(exc)
            )
        return EXIT_FAILURE
    except (OSError, InvalidResourceList) as exc:
        print(f"fnkernel eval: {exc}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        chain.close()
    _report(outcome, args.output, args.dry_run)
    return EXIT_OK


def _export(args: argparse.Namespace) -> int:
    from fnkernel.runtime_server.krm.export import ExportError, export

    source = client_of(args).files(args.name)
    out = Path(args.output or f"{args.name}.pyz")
    try:
        written = export(source["name"], source["runtime"], source["handler"], source["files"], out)
    except ExportError as exc:
        raise UsageError(str(exc)) from None
    print(f"exported {args.name} to {written}")
    return EXIT_OK


def _evaluator(args: argparse.Namespace) -> int:
    from fnkernel.runtime_server import daemon, logs
    from fnkernel.runtime_server.daemon import announcement
    from fnkernel.runtime_server.krm.evaluators.server import serve

    logs.configure(logging.DEBUG if args.verbose else logging.INFO)
    daemon.keep_freed_memory()  # payloads pass through (docs/architecture.md)
    chain = chain_from_flags(args, "evaluator")
    try:
        server, address = serve(chain.evaluator(), args.listen)
    except RuntimeError as exc:
        chain.close()
        print(f"fnkernel evaluator: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    print(announcement("evaluator", f"chain {chain.describe()}", address), flush=True)
    daemon.wait_for_termination()
    server.stop(5).wait()
    chain.close()
    return EXIT_OK


def _wrapper_server(args: argparse.Namespace) -> int:
    from fnkernel.runtime_server import daemon, logs
    from fnkernel.runtime_server.daemon import announcement
    from fnkernel.runtime_server.krm.evaluators.server import serve
    from fnkernel.runtime_server.krm.evaluators.wrapper import WrapperEvaluator

    logs.configure(logging.INFO)
    daemon.keep_freed_memory()  # payloads pass through (docs/architecture.md)
    entrypoint = args.entrypoint[1:] if args.entrypoint[:1] == ["--"] else args.entrypoint
    if not entrypoint:
        print("fnkernel wrapper-server: give the function's entrypoint after --", file=sys.stderr)
        return EXIT_USAGE
    if args.max_request_body_size <= 0:
        print("fnkernel wrapper-server: --max-request-body-size must be positive", file=sys.stderr)
        return EXIT_USAGE
    listen = args.listen or f"127.0.0.1:{args.port}"
    try:
        server, address = serve(
            WrapperEvaluator(entrypoint), listen, max_bytes=args.max_request_body_size
        )
    except RuntimeError as exc:
        print(f"fnkernel wrapper-server: cannot listen on {listen}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    print(announcement("wrapper-server", " ".join(entrypoint), address), flush=True)
    daemon.wait_for_termination()
    server.stop(5).wait()
    return EXIT_OK


def register(commands: Any) -> None:
    """Add the subcommands of this group to `commands` (argparse subparsers)."""
    render = commands.add_parser(
        "render",
        help="render a kpt package: run its Kptfile pipeline in place",
        description="kpt fn render semantics: subpackages first, mutators then validators; any "
        "failure leaves every file untouched. One progress line per step on stderr.",
    )
    render.add_argument("dir", metavar="DIR")
    render.add_argument("--allow-exec", action="store_true", help="allow `exec` pipeline steps")
    render.add_argument("--dry-run", action="store_true", help="run, but write no file")
    render.add_argument(
        "--results-dir",
        metavar="D",
        type=results_dir,
        help="write results.yaml (FunctionResultList)",
    )
    render.add_argument("--output", choices=("text", "json"), default="text")
    add_chain_flags(render)
    add_bound_flags(render)
    render.set_defaults(func=_render)

    evaluate = commands.add_parser(
        "eval",
        help="run one KRM function over the resources in a directory",
        description="kpt fn eval semantics: IMAGE over DIR's resources, configured by --fn-config "
        "or by key=value pairs after -- (a ConfigMap).",
    )
    evaluate.add_argument("image", metavar="IMAGE")
    evaluate.add_argument("dir", metavar="DIR")
    evaluate.add_argument("--fn-config", metavar="F", help="the function config (one KRM object)")
    evaluate.add_argument("--dry-run", action="store_true")
    evaluate.add_argument("--output", choices=("text", "json"), default="text")
    add_chain_flags(evaluate)
    add_bound_flags(evaluate)
    evaluate.set_defaults(func=_eval, pairs=[])  # `-- key=value ...`: cli.main takes them
    export = commands.add_parser(
        "export",
        help="a %%function --krm function as an executable KRM function (a Python zipapp)",
        description="Write the function NAME, as registered on the gateway, to one executable "
        "file that reads a ResourceList on stdin and writes one on stdout, without fnkernel: for "
        "kpt fn eval --exec, a Kptfile exec step or a kustomize exec function.",
    )
    export.add_argument("name", metavar="NAME")
    export.add_argument("-o", "--output", metavar="PATH", help="the file (default: ./NAME.pyz)")
    add_client_flags(export)
    export.set_defaults(func=_export)
    kpt.add_fn_group(commands)
    kpt.add_pkg_group(commands)

    evaluator = commands.add_parser(
        "evaluator",
        help="serve the evaluator chain over FunctionEvaluator (KRM functions)",
        description="Serve evaluator.FunctionEvaluator over the chain builtin → exec → pod: only "
        "NotFound falls through to the next evaluator.",
    )
    evaluator.add_argument(
        "--listen", type=listen_address, default="127.0.0.1:9445", metavar="ADDR"
    )
    add_chain_flags(evaluator)
    evaluator.add_argument("-v", "--verbose", action="store_true")
    evaluator.set_defaults(func=_evaluator)

    wrapper = commands.add_parser(
        "wrapper-server",
        help="serve one KRM function entrypoint over FunctionEvaluator (a function pod)",
        description="Run ENTRYPOINT once per EvaluateFunction request with the ResourceList on "
        "stdin. Usage: fnkernel wrapper-server --port 9446 -- ENTRYPOINT...",
    )
    wrapper.add_argument("--port", type=port, default=9446, help="loopback port (0: any free one)")
    wrapper.add_argument(
        "--listen",
        type=listen_address,
        metavar="ADDR",
        help="host:port or unix:PATH instead of --port",
    )
    wrapper.add_argument(
        "--max-request-body-size",
        type=count,
        default=6 * 1024 * 1024,
        metavar="BYTES",
        help="largest ResourceList accepted (default 6 MiB)",
    )
    wrapper.add_argument("entrypoint", nargs=argparse.REMAINDER, metavar="-- ENTRYPOINT...")
    wrapper.set_defaults(func=_wrapper_server)
