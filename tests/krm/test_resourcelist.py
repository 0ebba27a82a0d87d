"""What a KRM function written as a handler returns (docs/krm.md, "A notebook function kpt can
run": "The handler gets the ResourceList's JSON and returns one"), applied onto its input the
one way the notebook's fn://NAME and the exported file both apply it."""

from __future__ import annotations

from typing import Any

import pytest

from fnkernel.runtime_server.krm.resources.resourcelist import (
    InvalidResourceList,
    ResourceList,
    load,
)

INPUT = b"""apiVersion: config.kubernetes.io/v1
kind: ResourceList
items:
- apiVersion: v1
  kind: ConfigMap
  metadata: {name: cart} # the cart
  data: {size: "3"}
"""


def test_what_a_handler_returns_is_applied_keeping_what_it_left_alone() -> None:
    rl = ResourceList.parse(INPUT)
    rl.apply({"items": [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cart"},
                         "data": {"size": "4"}}]})  # fmt: skip
    text = rl.to_bytes().decode()
    # Its apiVersion and kind, left out, stay; the unchanged line keeps its comment.
    assert text.startswith("apiVersion: config.kubernetes.io/v1\nkind: ResourceList\n")
    assert "metadata: {name: cart} # the cart" in text and 'size: "4"' in text


def test_a_resource_list_without_items_removes_every_resource() -> None:
    rl = ResourceList.parse(INPUT)
    rl.apply({"apiVersion": "config.kubernetes.io/v1", "kind": "ResourceList"})
    assert rl.items == [] and load(rl.to_bytes())["kind"] == "ResourceList"


@pytest.mark.parametrize(
    "output, why",
    [
        ({"hello": 1}, "it has no items (its keys: hello)"),
        ([], "got a list"),
        (None, "got null"),
        ("items", "got a string"),
        ({"items": "nope"}, "items must be a list of KRM objects"),
        ({"items": [1]}, "items must be a list of KRM objects"),
        ({"kind": "ConfigMap", "items": []}, "kind must be ResourceList, got 'ConfigMap'"),
    ],
)
def test_what_is_no_resource_list_is_refused_saying_why_and_changes_nothing(
    output: Any, why: str
) -> None:
    rl = ResourceList.parse(INPUT)
    with pytest.raises(InvalidResourceList) as raised:
        rl.apply(output)
    assert str(raised.value) == why
    assert rl.to_bytes() == ResourceList.parse(INPUT).to_bytes()
