"""``set-image``, as the catalog's function behaves (docs/krm.md, "Builtin functions").

It rewrites each container image that names the config's ``name`` (with any tag or digest):
the ``containers`` of a Pod and of the pod template of a Deployment, StatefulSet, ReplicaSet,
DaemonSet or PodTemplate, and the fields the config's ``additionalImageFields`` name in any
kind. One result counts what changed.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from fnkernel.runtime_server.krm.functions.set_metadata import FieldSpec
from fnkernel.runtime_server.krm.resources.resourcelist import (
    ERROR,
    INFO,
    ResourceList,
    Result,
    kind,
    walk,
)

# The catalog's function reads `iniContainers` (sic) beside `containers`: init containers are left
# as they are, and so are they here.
_POD_TEMPLATE_KINDS = ("Deployment", "StatefulSet", "ReplicaSet", "DaemonSet", "PodTemplate")
_CONFIG_KEYS = ("name", "newName", "newTag", "digest")


@dataclass(frozen=True)
class Image:
    """What to set: images named `name` get `new_name`, `new_tag` or `digest`."""

    name: str
    new_name: str = ""
    new_tag: str = ""
    digest: str = ""

    def matches(self, value: str) -> bool:
        # kustomize's rule (the name is a regular expression, as there): the name, then an
        # optional tag and an optional sha256 digest.
        pattern = f"^{self.name}(:[a-zA-Z0-9_.{{}}-]*)?(@sha256:[a-zA-Z0-9_.{{}}-]*)?$"
        try:
            return re.match(pattern, value) is not None
        except re.error:
            return False

    def apply(self, value: str) -> str:
        """The image `value` becomes, as kustomize's images transformer writes it: a new tag
        drops the digest, a digest drops the tag."""
        name, tag, digest = split(value)
        name = self.new_name or name
        if self.new_tag:
            tag, digest = self.new_tag, self.digest
        elif self.digest:
            tag, digest = "", self.digest
        return name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")


def split(image: str) -> tuple[str, str, str]:
    """(name, tag, digest) of an image reference; a registry's port is part of the name."""
    slash = image.find("/")
    start = slash if slash > 0 else 0
    rest = image[start:]
    at, colon = rest.find("@"), rest.find(":")
    if at < 0 and colon < 0:
        return image, "", ""
    if at >= 0 and (colon < 0 or at < colon):
        return image[: start + at], "", image[start + at + 1 :]
    if at >= 0:
        return (
            image[: start + colon],
            image[start + colon + 1 : start + at],
            image[start + at + 1 :],
        )
    return image[: start + colon], image[start + colon + 1 :], ""


def read_config(config: Mapping[str, Any] | None) -> tuple[Image, list[FieldSpec]]:
    """The image and extra field specs from a ConfigMap's ``data`` or a ``SetImage``'s
    ``image`` and ``additionalImageFields``; ValueError with the catalog's message."""
    config = config or {}
    wanted: dict[str, str] = {}
    image = config.get("image")
    if isinstance(image, Mapping):
        wanted.update({key: str(image[key]) for key in _CONFIG_KEYS if image.get(key)})
    data = config.get("data")
    if isinstance(data, Mapping):
        for key, value in data.items():
            if key not in _CONFIG_KEYS:
                raise ValueError(f"ConfigMap has wrong field name {key}")
            wanted[str(key)] = str(value)
    if not wanted.get("name"):
        raise ValueError("must specify `name`")
    if not any(wanted.get(key) for key in ("newName", "newTag", "digest")):
        raise ValueError("must specify one of `newName`, `newTag`, or `digest`")
    extra = [
        FieldSpec.of(node, "additionalImageFields")
        for node in config.get("additionalImageFields") or []
    ]
    return (
        Image(
            wanted["name"],
            wanted.get("newName", ""),
            wanted.get("newTag", ""),
            wanted.get("digest", ""),
        ),
        extra,
    )


def set_image(rl: ResourceList) -> None:
    try:
        image, extra = read_config(rl.function_config)
    except ValueError as exc:
        rl.add_results([Result(str(exc), ERROR)])
        return
    count = 0
    for obj in rl.items:
        for container in _containers(obj):
            old = container.get("image")
            if not isinstance(old, str) or not image.matches(old):
                continue
            new = image.apply(old)
            if new != old:
                container["image"] = new
                count += 1
    for spec in extra:
        *parents, field = spec.path.split("/")
        for obj in rl.items:
            if not spec.applies(obj):
                continue
            for holder in _holders(obj, parents):
                value = holder.get(field)
                if isinstance(value, str) and image.matches(value):
                    holder[field] = image.apply(value)
                    count += 1  # kustomize counts every value it sets
    rl.add_results([Result(f"summary: updated a total of {count} image(s)", INFO)])


def _holders(obj: Mapping[str, Any], parents: list[str]) -> Iterator[dict[str, Any]]:
    """The mappings that hold a field spec's last field: at its parent path, each element of
    a list there."""
    if not parents:
        yield obj  # type: ignore[misc]
        return
    for parent in walk(obj, parents[:-1], create=False):
        child = parent.get(parents[-1].removesuffix("[]"))
        for element in child if isinstance(child, list) else [child]:
            if isinstance(element, dict):
                yield element


def _containers(obj: dict[str, Any]) -> Iterator[dict[str, Any]]:
    spec = obj.get("spec")
    if not isinstance(spec, Mapping):
        return
    if kind(obj) in _POD_TEMPLATE_KINDS:
        template = spec.get("template")
        spec = template.get("spec") if isinstance(template, Mapping) else None
    elif kind(obj) != "Pod":
        return
    if not isinstance(spec, Mapping):
        return
    containers = spec.get("containers")
    for container in containers if isinstance(containers, list) else ():
        if isinstance(container, dict):
            yield container
