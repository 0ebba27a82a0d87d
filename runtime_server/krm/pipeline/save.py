"""``kpt fn eval --save``: the function that ran, put in the package's Kptfile pipeline."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ruamel.yaml.comments import CommentedMap, CommentedSeq

from fnkernel.runtime_server.krm.pipeline.steps import PipelineFunction, qualified
from fnkernel.runtime_server.krm.pipeline.writer import stage
from fnkernel.runtime_server.krm.resources import resourcelist
from fnkernel.runtime_server.krm.resources.package import KPTFILE, dump_text


def save_function(
    root: Path,
    function: PipelineFunction,
    stage_name: str,
    config_path: Path | None,
    data: Mapping[str, str],
) -> str:
    """``kpt fn eval --save``: put the function that ran in the package's Kptfile pipeline
    (`stage_name` "mutator" or "validator"), replacing one of the same image or command.
    Returns what kpt says about it."""
    try:
        text = (root / KPTFILE).read_text()
    except FileNotFoundError:
        return "function not added: Kptfile not exists"
    document = resourcelist.load(text)
    entry: dict[str, Any] = {}
    if function.image:
        entry["image"] = qualified(function.image)
    else:
        entry["exec"] = function.command
    if config_path is not None:
        entry["configPath"] = os.path.relpath(config_path.resolve(), root.resolve())
    elif data:
        entry["configMap"] = dict(data)
    if function.selectors:
        entry["selectors"] = list(function.selectors)
    if function.exclude:
        entry["exclude"] = list(function.exclude)
    pipeline = document.setdefault("pipeline", CommentedMap())
    functions = pipeline.get(f"{stage_name}s")
    if not isinstance(functions, list):
        functions = pipeline[f"{stage_name}s"] = CommentedSeq()
    name = entry.get("image") or entry["exec"]
    message = f'Added "{name}" as {stage_name} in the Kptfile.'
    node = resourcelist.block_style(entry)
    for index, existing in enumerate(functions):
        same = existing.get("image") if "image" in entry else existing.get("exec")
        if same == name:
            functions[index] = node
            message = f'Updated "{name}" as {stage_name} in the Kptfile.'
            break
    else:
        functions.append(node)
    # kpt writes the Kptfile with its sequences indented, keeping its comments
    target = root / KPTFILE
    os.replace(stage(target, dump_text(document, "wide")), target)
    return message
