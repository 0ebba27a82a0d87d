"""The exec evaluator: a cached function binary run locally (docs/protocol.md, "Evaluators").

The FunctionConfig store (a YAML list of ``{image, tags, path}``, ``path`` relative to
``--functions``) maps an image to its binary and so sets ``exec_path``; a request whose
``exec_path`` is empty is ``NotFoundError``, so the chain falls through to the pod evaluator. The
binary must resolve — symlinks followed — inside ``--functions``. It reads the ResourceList on
stdin, prints the result on stdout and logs on stderr; it runs within the step's bounds
(``krm.functions.processes``): the deadline kills its process group, and its memory is bounded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fnkernel.runtime_server.errors import FunctionError, InvalidEvaluateRequest, NotFoundError
from fnkernel.runtime_server.krm.evaluators.base import EvalRequest, EvalResponse, split_image
from fnkernel.runtime_server.krm.functions.processes import (
    memory_message,
    out_of_memory,
    run_function,
)
from fnkernel.runtime_server.krm.resources import resourcelist


@dataclass(frozen=True)
class FunctionConfig:
    image: str
    tags: tuple[str, ...]
    path: str

    def matches(self, image: str, tag: str) -> bool:
        return image == self.image and (not tag or not self.tags or tag in self.tags)


class FunctionConfigStore:
    """Image (+ tag) → cached binary under the functions directory."""

    def __init__(self, functions_dir: Path, entries: list[FunctionConfig]) -> None:
        self.functions_dir = functions_dir.resolve()
        self.entries = entries

    @classmethod
    def load(cls, functions_dir: Path, config_file: Path) -> FunctionConfigStore:
        document: Any = resourcelist.load(config_file.read_text())
        if isinstance(document, dict):
            document = document.get("functions")
        if not isinstance(document, list):
            raise ValueError(f"{config_file}: expected a list of {{image, tags, path}} entries")
        entries = []
        for number, entry in enumerate(document, 1):
            if not isinstance(entry, dict) or not entry.get("image") or not entry.get("path"):
                raise ValueError(f"{config_file}: entry {number} needs image and path")
            tags = entry.get("tags") or []
            entries.append(
                FunctionConfig(str(entry["image"]), tuple(map(str, tags)), str(entry["path"]))
            )
        return cls(functions_dir, entries)

    def exec_path(self, image: str, tag: str = "") -> str:
        """The absolute path of the binary for `image`, or "" when none is cached."""
        name, image_tag = split_image(image)
        for entry in self.entries:
            if entry.matches(name, tag or image_tag):
                return str(self.functions_dir / entry.path)
        return ""


MAX_EXEC_PATH_BYTES = 4096  # PATH_MAX


def confined(exec_path: str, functions_dir: Path) -> Path:
    """`exec_path` with symlinks resolved, if it stays inside `functions_dir`."""
    shown = exec_path if len(exec_path) <= 200 else exec_path[:200] + "..."
    if "\0" in exec_path:
        raise InvalidEvaluateRequest(f"exec_path {shown!r} contains a NUL byte")
    if len(exec_path.encode()) > MAX_EXEC_PATH_BYTES:
        raise InvalidEvaluateRequest(
            f"exec_path is {len(exec_path.encode())} bytes; at most {MAX_EXEC_PATH_BYTES}"
        )
    path = Path(exec_path)
    if not path.is_absolute():
        raise InvalidEvaluateRequest(f"exec_path {shown!r} must be absolute")
    try:
        real = path.resolve()
    except OSError as exc:  # a symlink loop, say
        raise InvalidEvaluateRequest(
            f"exec_path {shown!r} cannot be resolved: {exc.strerror}"
        ) from None
    root = functions_dir.resolve()
    if not real.is_relative_to(root):
        raise InvalidEvaluateRequest(
            f"exec_path {exec_path} resolves to {real}, outside --functions {root}"
        )
    if not real.is_file() or not os.access(real, os.X_OK):
        raise InvalidEvaluateRequest(f"exec_path {exec_path} is not an executable file")
    return real


def parse_results(stdout: bytes) -> list[dict[str, Any]]:
    """The ``results`` of the ResourceList a function printed, if it printed one."""
    try:
        rl = resourcelist.ResourceList.parse(stdout)
    except (resourcelist.InvalidResourceList, ValueError):
        return []
    return [dict(result) for result in rl.results if isinstance(result, dict)]


class ExecEvaluator:
    name = "exec"

    def __init__(self, functions_dir: Path, store: FunctionConfigStore | None = None) -> None:
        self.functions_dir = functions_dir.resolve()
        self.store = store

    def evaluate(self, request: EvalRequest, deadline: float | None = None) -> EvalResponse:
        exec_path = request.exec_path
        if not exec_path and self.store is not None:
            exec_path = self.store.exec_path(request.image, request.tag)
        if not exec_path:
            raise NotFoundError(f"no cached binary for {request.image}")
        binary = confined(exec_path, self.functions_dir)
        code, stdout, stderr = run_function([str(binary)], request.serialized(), deadline)
        if code != 0:
            log = stderr.decode("utf-8", "replace")
            detail = log.strip()[-500:]
            if out_of_memory(code, stderr):  # in stderr too: kpt's report shows a failed stderr
                detail = memory_message(request.image)
                log = f"{log.rstrip()}\nfnkernel: {detail}\n"
            raise FunctionError(
                f"{request.image} exited with {code}: {detail}",
                exit_code=code,
                stderr=log,
                results=parse_results(stdout),
                resource_list=stdout,
            )
        return EvalResponse(stdout, stderr, self.name)
