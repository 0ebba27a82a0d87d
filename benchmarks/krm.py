"""KRM pipeline costs against floors measured in the same run (issue 5):

* render: set-namespace + set-labels over 1,000 resources (a package of 10 files), dry run, as
  ``fnkernel render`` runs it (no per-step diffs), vs the ruamel.yaml floor of the same work:
  loading the package's files and dumping the files the render makes (1.9x the input's size:
  set-labels adds labels in three places) — target <= 1.3x; and, reported, vs a round trip of
  the input files alone. They run in turns; each ratio is the median of the rounds' ratios;
* exec: one exec-evaluator call vs running the same binary directly with subprocess — <= 1.15x;
* pod: one call to a warm pod vs the exec-evaluator call of the same program — <= 1.2x;
* cold pod start: the first call for an image with no pod, from an evaluator whose backend's
  waiting process is ready — <= 150 ms; and, reported, the same with no process waiting.

Usage: python -m benchmarks.krm [--rounds N]
"""

from __future__ import annotations

import argparse
import io
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.invoke import Target, verdicts
from fnkernel.runtime_server.krm.evaluators.base import EvalRequest
from fnkernel.runtime_server.krm.evaluators.builtin import BuiltinEvaluator
from fnkernel.runtime_server.krm.evaluators.exec import ExecEvaluator
from fnkernel.runtime_server.krm.evaluators.pods import LocalBackend, PodCacheManager, PodEvaluator
from fnkernel.runtime_server.krm.pipeline import render
from fnkernel.runtime_server.krm.resources.resourcelist import yaml

TARGETS = {"render": 1.3, "exec": 1.15, "pod": 1.2, "cold pod ms": 150.0}  # issue 13
KPTFILE = """\
apiVersion: kpt.dev/v1
kind: Kptfile
metadata:
  name: bench
pipeline:
  mutators:
  - image: set-namespace:v0.4.1
    configMap: {namespace: prod}
  - image: set-labels
    configMap: {app: shop, tier: backend}
"""
DEPLOYMENT = """\
apiVersion: apps/v1
kind: Deployment
metadata:
  name: web-{n} # service {n}
  namespace: dev
spec:
  replicas: 2
  template:
    spec:
      containers:
      - name: web
        image: nginx:1.{n}
"""


def in_turns(cases: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Each case's times (ms), the cases run in turns, each round in another order, so that a
    slow stretch of this noisy machine falls on all of them rather than on whichever ran
    during it. Compare two cases by the median of their per-round ratios (``ratio``)."""
    for call in cases.values():
        call()  # warm up
    times: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            started = time.perf_counter()
            cases[name]()
            times[name].append((time.perf_counter() - started) * 1000)
    return times


def ratio(times: dict[str, list[float]], subject: str, floor: str) -> float:
    return statistics.median(s / f for s, f in zip(times[subject], times[floor], strict=True))


def make_package(root: Path, resources: int = 1000, files: int = 10) -> list[Path]:
    root.mkdir(parents=True)
    (root / "Kptfile").write_text(KPTFILE)
    paths = []
    per_file = resources // files
    for f in range(files):
        path = root / f"deployments-{f}.yaml"
        path.write_text(
            "---\n".join(DEPLOYMENT.format(n=f * per_file + i) for i in range(per_file))
        )
        paths.append(path)
    return paths


def round_trip(paths: list[Path]) -> None:
    for path in paths:
        codec = yaml()
        documents = list(codec.load_all(path.read_text()))
        codec.dump_all(documents, io.StringIO())


def load_and_dump(paths: list[Path], outputs: list[list[object]]) -> None:
    """The floor of a render: load the package's files and dump what the render makes of them
    (set-labels adds labels in three places, so the output is larger than the input)."""
    for path in paths:
        list(yaml().load_all(path.read_text()))
    for documents in outputs:
        yaml().dump_all(documents, io.StringIO())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rows: list[tuple[str, float, float | None]] = []
    with tempfile.TemporaryDirectory(prefix="fnkernel-bench-") as tmp:
        work = Path(tmp)
        paths = make_package(work / "package")
        chain = BuiltinEvaluator()
        rendered = render(work / "package", chain, dry_run=True, diffs=False).after
        outputs = [
            list(yaml().load_all(text)) for name, text in rendered.items() if name != "Kptfile"
        ]
        times = in_turns(
            {
                "file by file": lambda: round_trip(paths),
                "input and output": lambda: load_and_dump(paths, outputs),
                "render": lambda: render(work / "package", chain, dry_run=True, diffs=False),
            },
            args.rounds,
        )
        render_ratio = ratio(times, "render", "input and output")
        pipeline = statistics.median(times["render"])
        rows += [
            (
                "ruamel.yaml: load the input, dump the output",
                statistics.median(times["input and output"]),
                None,
            )
        ]
        rows += [("render: set-namespace + set-labels", pipeline, render_ratio)]
        rows += [
            (
                "  ruamel.yaml round trip of the input",
                statistics.median(times["file by file"]),
                ratio(times, "render", "file by file"),
            )
        ]

        program = work / "functions" / "identity"
        program.parent.mkdir()
        program.write_text(f"#!{sys.executable}\nimport sys\nsys.stdout.write(sys.stdin.read())\n")
        program.chmod(0o755)
        small = (
            b"apiVersion: config.kubernetes.io/v1\nkind: ResourceList\nitems:\n"
            + textwrap.indent(DEPLOYMENT.format(n=1), "  ")
            .replace("  apiVersion", "- apiVersion", 1)
            .encode()
        )
        exec_evaluator = ExecEvaluator(program.parent)
        request = EvalRequest(small, "example.com/fn/identity", exec_path=str(program))
        pod_request = EvalRequest(small, "example.com/fn/identity")
        catalog = {"example.com/fn/identity": [str(program)]}
        # From nothing: the wrapper-server's own start (imports) and the call.
        manager = PodCacheManager(LocalBackend(catalog, prewarm=False))
        try:
            started = time.perf_counter()
            PodEvaluator(manager).evaluate(pod_request)
            unwarmed = (time.perf_counter() - started) * 1000
        finally:
            manager.stop()
        # As an evaluator serves it: its backend's waiting process is ready by the first call.
        backend = LocalBackend(catalog)
        manager = PodCacheManager(backend)
        try:
            assert backend.wait_ready(30)
            pods = PodEvaluator(manager)
            started = time.perf_counter()
            pods.evaluate(pod_request)
            cold = (time.perf_counter() - started) * 1000
            assert backend.wait_ready(30)  # steady state: the next waiting process has imported
            calls = in_turns(
                {
                    "direct": lambda: subprocess.run(
                        [str(program)], input=small, capture_output=True, check=True
                    ),
                    "exec": lambda: exec_evaluator.evaluate(request),
                    "warm pod": lambda: pods.evaluate(pod_request),
                },
                args.rounds * 8,
            )
        finally:
            manager.stop()
        exec_ratio, pod_ratio = ratio(calls, "exec", "direct"), ratio(calls, "warm pod", "exec")
        rows += [("subprocess.run of the binary", statistics.median(calls["direct"]), None)]
        rows += [("exec evaluator call", statistics.median(calls["exec"]), exec_ratio)]
        rows += [("warm pod call", statistics.median(calls["warm pod"]), pod_ratio)]
        rows += [("cold pod start (first call)", cold, None)]
        rows += [("  the same with no process waiting", unwarmed, None)]

    print(f"{'case':<46}{'median ms':>11}{'ratio':>8}")
    for name, ms, against in rows:
        print(f"{name:<46}{ms:>11.2f}{f'{against:.2f}x' if against is not None else '':>8}")
    return verdicts(
        [
            Target("render / load input + dump output", render_ratio, TARGETS["render"]),
            Target("exec evaluator / direct subprocess", exec_ratio, TARGETS["exec"]),
            Target("warm pod / exec evaluator", pod_ratio, TARGETS["pod"]),
            Target("cold pod start (first call)", cold, TARGETS["cold pod ms"], " ms"),
        ]
    )


if __name__ == "__main__":
    raise SystemExit(main())
