"""The evaluator chain, assembled in this one place (docs/architecture.md, "The KRM chain").

builtin always; exec when a directory of cached function binaries is given (``--functions``,
mapped from images by a FunctionConfig store); pod when a local image catalog is given. The
order is fixed and only ``NotFoundError`` falls through (``MultiEvaluator``). ``fnkernel
evaluator``, ``fnkernel render`` / ``eval`` and the kernel's ``%krm`` all build theirs here, and a
pipeline's ``exec:`` steps get theirs from ``exec_step``.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from fnkernel.runtime_server.krm.evaluators.base import Evaluator
from fnkernel.runtime_server.krm.evaluators.builtin import BuiltinEvaluator
from fnkernel.runtime_server.krm.evaluators.multi import MultiEvaluator
from fnkernel.runtime_server.krm.functions.processes import Bounds


class Chain:
    """builtin → exec → pod, each after the first only once ``configure`` names what it needs;
    with how its pipelines run: whether a Kptfile's ``exec`` steps may (`allow_exec`), and each
    function's time and memory (`bounds`)."""

    def __init__(self) -> None:
        self.builtin = BuiltinEvaluator()
        self.extra: list[Evaluator] = []
        self._manager: Any = None  # the pod cache manager, which owns pods to stop
        self.allow_exec = False  # a Kptfile's `exec` steps run only when allowed, as in kpt
        self.bounds = Bounds()

    def configure(
        self,
        *,
        functions: str | Path | None = None,
        function_config: str | Path | None = None,
        image_catalog: str | Path | None = None,
        pod_cache_config: str | Path | None = None,
        allow_exec: bool = False,
        timeout: float | None = None,
        memory_mb: int | None = None,
    ) -> Chain:
        """Add the exec evaluator (cached binaries under `functions`, mapped by the
        `function_config` store) and the pod evaluator (wrapper-server pods from the
        `image_catalog`, warmed up from `pod_cache_config`); `allow_exec` lets a Kptfile's
        ``exec`` steps run (``--allow-exec``); `timeout` and `memory_mb` bound each function
        (``--timeout``, ``--memory``; docs/krm.md, "Limits"). ValueError (naming the flag),
        InvalidField (naming the argument out of range) or OSError for a configuration that
        cannot be used; the chain is then unchanged."""
        bounds = Bounds(
            timeout=self.bounds.timeout if timeout is None else timeout,
            memory_mb=self.bounds.memory_mb if memory_mb is None else memory_mb,
        )
        if function_config is not None and functions is None:
            raise ValueError("--function-config needs --functions")
        if pod_cache_config is not None and image_catalog is None:
            raise ValueError("--pod-cache-config needs --image-catalog")
        extra: list[Evaluator] = []
        if functions is not None:
            from fnkernel.runtime_server.krm.evaluators.exec import (
                ExecEvaluator,
                FunctionConfigStore,
            )

            directory = Path(functions)
            if not directory.is_dir():
                raise ValueError(f"--functions {directory} is not a directory")
            store = None
            if function_config is not None:
                try:
                    store = FunctionConfigStore.load(directory, Path(function_config))
                except (OSError, ValueError) as exc:
                    raise ValueError(f"--function-config: {exc}") from None
            extra.append(ExecEvaluator(directory, store))
        manager = None
        if image_catalog is not None:
            from fnkernel.runtime_server.krm.evaluators.pods import (
                LocalBackend,
                PodCacheManager,
                PodEvaluator,
                load_catalog,
                load_warmup,
            )

            try:
                catalog = load_catalog(Path(image_catalog))
                warmup = load_warmup(Path(pod_cache_config)) if pod_cache_config else {}
            except (OSError, ValueError) as exc:
                raise ValueError(f"--image-catalog / --pod-cache-config: {exc}") from None
            manager = PodCacheManager(LocalBackend(catalog), warmup)
            manager.warm_up(list(warmup))
            extra.append(PodEvaluator(manager))
        self.close()
        self.extra, self._manager = extra, manager
        self.allow_exec, self.bounds = allow_exec, bounds
        return self

    def evaluator(self) -> MultiEvaluator:
        return MultiEvaluator([self.builtin, *self.extra])

    def describe(self) -> str:
        """The order, e.g. ``builtin → exec → pod``."""
        return " → ".join(evaluator.name for evaluator in [self.builtin, *self.extra])

    def close(self) -> None:
        """Stop the pods the chain started."""
        if self._manager is not None:
            self._manager.stop()
            self._manager = None


def exec_step(command: str) -> Evaluator:
    """A Kptfile's ``exec:`` step: the command, run as a function pod's entrypoint is (a relative
    path is the current directory's, as in kpt). Whether it may run at all is the pipeline's
    ``allow_exec``."""
    from fnkernel.runtime_server.krm.evaluators.wrapper import WrapperEvaluator

    return WrapperEvaluator(shlex.split(command), f"exec: {command}")
