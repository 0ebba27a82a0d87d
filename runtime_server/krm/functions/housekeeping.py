"""The catalog's functions that tidy a package rather than configure it, as their Go sources do
(docs/krm.md, "Builtin functions"): ``no-op``, ``remove-local-config-resources`` and
``drop-comments``."""

from __future__ import annotations

from typing import Any

from ruamel.yaml.comments import CommentedBase

from fnkernel.runtime_server.krm.functions.fields import file_path
from fnkernel.runtime_server.krm.resources.resourcelist import (
    INFO,
    WARNING,
    ResourceList,
    Result,
    is_local_config,
)


def no_op(rl: ResourceList) -> None:
    """The resources back as they came, and no result."""


def remove_local_config_resources(rl: ResourceList) -> None:
    """Drop every resource annotated ``config.kubernetes.io/local-config: "true"`` (any case),
    with a result naming each and their count first; a warning when there was none."""
    kept, pruned = [], []
    for item in rl.items:
        if not item:
            continue
        if is_local_config(item):
            name = str((item.get("metadata") or {}).get("name", ""))
            pruned.append(Result(f"Resource name: [{name}]", INFO, file_path=file_path(item)))
        else:
            kept.append(item)
    rl.items[:] = kept
    if not pruned:
        rl.add_results(
            [Result("Found no resources to prune with the local config annotation", WARNING)]
        )
        return
    rl.add_results([Result(f"Number of resources pruned: {len(pruned)}", INFO), *pruned])


def drop_comments(rl: ResourceList) -> None:
    """Remove every comment from every resource. Run by a pipeline, the comments come back
    afterwards, as they do in kpt: it restores what a function drops (docs/krm.md, "Comments")."""
    for item in rl.items:
        _uncomment(item)


def _uncomment(node: Any) -> None:
    if isinstance(node, CommentedBase):
        node.ca.comment = None
        node.ca.items.clear()
        node.ca.end = []
    if isinstance(node, dict):
        for value in node.values():
            _uncomment(value)
    elif isinstance(node, list):
        for value in node:
            _uncomment(value)
