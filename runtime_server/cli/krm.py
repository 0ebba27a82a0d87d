"""KRM pipelines: ``render`` and ``eval`` (kpt's ``fn render`` and ``fn eval``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime_server.cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    add_chain_flags,
    chain_from_flags,
)

if TYPE_CHECKING:
    pass


def _step_line(step: Any, number: int) -> str:
    mark = "ok" if step.ok else "FAILED"
    where = f"{step.package}: " if step.package else ""
    line = f"[{number}] {where}{step.stage} {step.function} ({step.evaluator or '-'}) "
    line += f"{step.duration * 1000:.0f} ms {mark}"
    counts: dict[str, int] = {}
    for result in step.results:
        severity = str(result.get("severity", "info"))
        counts[severity] = counts.get(severity, 0) + 1
    if counts:
        line += " · " + ", ".join(f"{n} {severity}" for severity, n in sorted(counts.items()))
    if step.error:
        line += f"\n    {step.error}"
    return line


def _report(outcome: Any, output: str) -> None:
    if output == "json":
        print(
            json.dumps(
                {
                    "steps": [
                        {
                            "package": s.package,
                            "stage": s.stage,
                            "function": s.function,
                            "evaluator": s.evaluator,
                            "durationMs": round(s.duration * 1000, 1),
                            "results": s.results,
                            "error": s.error,
                        }
                        for s in outcome.steps
                    ],
                    "written": outcome.written,
                    "removed": outcome.removed,
                },
                indent=2,
                default=str,
            )
        )
        return
    changed = outcome.written + [f"{path} (removed)" for path in outcome.removed]
    print(f"{len(outcome.steps)} step(s); files changed: {', '.join(changed) or 'none'}")


def _render(args: argparse.Namespace) -> int:
    from runtime_server.krm.pipeline import PipelineError, render
    from runtime_server.krm.resources.package import PackageError
    from runtime_server.krm.resources.resourcelist import InvalidResourceList

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
        )
    except (PipelineError, PackageError) as exc:
        print(f"fnkernel render: {exc}; no file was changed", file=sys.stderr)
        return EXIT_FAILURE
    except (FileNotFoundError, InvalidResourceList) as exc:
        print(f"fnkernel render: {exc}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        chain.close()
    _report(outcome, args.output)
    return EXIT_OK


def _eval(args: argparse.Namespace) -> int:
    from runtime_server.client import parse_pairs
    from runtime_server.krm.pipeline import PipelineError, evaluate_one
    from runtime_server.krm.resources.package import PackageError, read_documents
    from runtime_server.krm.resources.resourcelist import InvalidResourceList

    pairs = args.pairs[1:] if args.pairs[:1] == ["--"] else args.pairs
    try:
        data = parse_pairs(pairs)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    config = None
    chain = chain_from_flags(args, "eval")
    try:
        if args.fn_config:
            documents = read_documents(Path(args.fn_config).read_text(), args.fn_config)
            if len(documents) != 1:
                raise UsageError(f"--fn-config {args.fn_config} must hold exactly one object")
            config = documents[0]
        outcome = evaluate_one(
            Path(args.dir),
            args.image,
            chain.evaluator(),
            config=config,
            data=data,
            dry_run=args.dry_run,
            progress=lambda step: print(_step_line(step, 1), file=sys.stderr),
        )
    except (PipelineError, PackageError) as exc:
        print(f"fnkernel eval: {exc}; no file was changed", file=sys.stderr)
        return EXIT_FAILURE
    except (OSError, InvalidResourceList) as exc:
        print(f"fnkernel eval: {exc}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        chain.close()
    _report(outcome, args.output)
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
        "--results-dir", metavar="D", help="write results.yaml (FunctionResultList)"
    )
    render.add_argument("--output", choices=("text", "json"), default="text")
    add_chain_flags(render)
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
    evaluate.add_argument("pairs", nargs=argparse.REMAINDER, metavar="-- key=value")
    evaluate.set_defaults(func=_eval)
