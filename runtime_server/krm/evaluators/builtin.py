"""The builtin evaluator: KRM functions implemented in Python, run in-process (docs/protocol.md, "Evaluators").

Each function answers to its bare name and to the two catalog registries' names, with any tag or
digest: ``set-namespace``, ``ghcr.io/kptdev/krm-functions-catalog/set-namespace:v0.4.1``,
``gcr.io/kpt-fn/set-namespace@sha256:…``. Anything else is ``NotFoundError``.
"""

from __future__ import annotations

import difflib
import re
import threading
from collections.abc import Callable, Mapping

import semantic_version

from fnkernel.runtime_server.errors import FunctionError, InvalidEvaluateRequest, NotFoundError
from fnkernel.runtime_server.krm.evaluators.base import (
    EvalRequest,
    EvalResponse,
    remaining,
    split_image,
)
from fnkernel.runtime_server.krm.functions.housekeeping import (
    drop_comments,
    no_op,
    remove_local_config_resources,
)
from fnkernel.runtime_server.krm.functions.name_substring import ensure_name_substring
from fnkernel.runtime_server.krm.functions.processes import Bounds, running
from fnkernel.runtime_server.krm.functions.replacements import apply_replacements
from fnkernel.runtime_server.krm.functions.schemas import kubeconform, kubeval
from fnkernel.runtime_server.krm.functions.search_replace import search_replace
from fnkernel.runtime_server.krm.functions.set_image import set_image
from fnkernel.runtime_server.krm.functions.set_metadata import set_annotations, set_labels
from fnkernel.runtime_server.krm.functions.set_namespace import set_namespace
from fnkernel.runtime_server.krm.functions.setters import (
    apply_setters,
    create_setters,
    list_setters,
)
from fnkernel.runtime_server.krm.functions.starlark import starlark_run
from fnkernel.runtime_server.krm.functions.upsert_resource import upsert_resource
from fnkernel.runtime_server.krm.resources.resourcelist import (
    ERROR,
    FunctionFailure,
    InvalidResourceList,
    ResourceList,
)

KrmFunction = Callable[[ResourceList], None]
# What the catalog's functions print on stderr when they fail; kpt shows it and records it in the
# render status, so ours say the same (docs/krm.md, "Results").
FAILURE_STDERR = "failed to evaluate function: error: function failure"
CATALOG_PREFIXES = ("ghcr.io/kptdev/krm-functions-catalog/", "gcr.io/kpt-fn/")
FUNCTIONS: dict[str, KrmFunction] = {
    "set-namespace": set_namespace,
    "set-labels": set_labels,
    "set-annotations": set_annotations,
    "starlark": starlark_run,
    "apply-replacements": apply_replacements,
    "no-op": no_op,
    "remove-local-config-resources": remove_local_config_resources,
    "drop-comments": drop_comments,
    "set-image": set_image,
    "apply-setters": apply_setters,
    "create-setters": create_setters,
    "list-setters": list_setters,
    "search-replace": search_replace,
    "upsert-resource": upsert_resource,
    "kubeconform": kubeconform,
    "kubeval": kubeval,
    "ensure-name-substring": ensure_name_substring,
}

# The catalog's releases each builtin answers for (its git tags, and the newer releases kpt's own
# cases resolve to): with no image registry here, a Kptfile step's semver `tag:` is resolved
# against these (docs/krm.md, "Image tags"). Whatever the tag, the function that runs is ours.
VERSIONS: dict[str, tuple[str, ...]] = {
    "set-namespace": (
        *(f"v0.1.{n}" for n in range(5)),
        "v0.2.0",
        *(f"v0.3.{n}" for n in range(5)),
        "v0.4.0",
        "v0.4.1",
        "v0.4.3",
    ),
    "set-labels": ("v0.1.3", "v0.1.4", "v0.1.5", "v0.2.0", "v0.2.1", "v0.2.5"),
    "set-annotations": ("v0.1.3", "v0.1.4"),
    "starlark": (
        *("v0.1.0", "v0.1.1", "v0.1.2", "v0.2.0", "v0.2.1", "v0.2.2", "v0.3.0"),
        *("v0.4.0", "v0.4.1", "v0.4.2", "v0.4.3", "v0.5.0", "v0.5.1"),
    ),
    "apply-replacements": ("v0.1.0", "v0.1.1", "v0.1.2"),
    "remove-local-config-resources": ("v0.1.0",),
    "set-image": ("v0.1.0", "v0.1.1"),
    "apply-setters": ("v0.1.0", "v0.1.1", "v0.2.0", "v0.2.1"),
    "create-setters": ("v0.1.0",),
    "list-setters": ("v0.1.0",),
    "search-replace": ("v0.1", "v0.1.0", "v0.1.1", "v0.2.0"),
    "upsert-resource": ("v0.1.0", "v0.2.0"),
    "ensure-name-substring": ("v0.1.0", "v0.1.1", "v0.2.0"),
    "kubeval": ("v0.1.0", "v0.1.1", "v0.1.2", "v0.2.0", "v0.2.1", "v0.3.0"),
}
# What Masterminds' semver (kpt's) takes as a version rather than a constraint: the tag is used
# as it is. An image tag's own grammar (OCI distribution).
_VERSION = re.compile(r"v?\d+(\.\d+){0,2}(-[0-9A-Za-z.-]+)?(\+[0-9A-Za-z.-]+)?")
_IMAGE_TAG = re.compile(r"[\w][\w.-]{0,127}")
_OPERATOR_SPACE = re.compile(r"([<>=~^]+)\s+")


def resolve_tag(image: str, tag: str) -> str:
    """kpt's image for a Kptfile step's `image` and `tag`: a version (``0.4.1``) or any other
    literal tag replaces the image's own; a semver constraint (``~0.2``, ``0.4.1 - 0.4.3``,
    ``>= 0.4, < 0.5``) becomes the newest release of VERSIONS that satisfies it. ValueError with
    kpt's message when none does or the tag is not one."""
    name, _ = split_image(image)
    if not tag:
        return image
    if _VERSION.fullmatch(tag) is None:
        spec = " ".join(_OPERATOR_SPACE.sub(r"\1", tag).replace(",", " ").split())
        try:
            constraint = semantic_version.NpmSpec(spec)
        except ValueError:
            constraint = None
        if constraint is not None:
            known = [
                (semantic_version.Version.coerce(v.removeprefix("v")), v)
                for v in VERSIONS.get(bare_name(name), ())
            ]
            matching = sorted((v for v in known if v[0] in constraint), reverse=True)
            if not matching:
                raise ValueError(f'no tag could be found matching the version constraint "{tag}"')
            return f"{name}:{matching[0][1]}"
    if _IMAGE_TAG.fullmatch(tag) is None:
        raise ValueError(
            f'`function.tag` "{tag}" must be a valid image tag: must start with an alphanumeric '
            "character or underscore, followed by at most 127 alphanumeric characters, "
            "underscores, periods, or dashes"
        )
    return f"{name}:{tag}"


def bare_name(image: str) -> str:
    """The function name an image refers to, without registry prefix, tag or digest."""
    name, _ = split_image(image)
    for prefix in CATALOG_PREFIXES:
        if name.startswith(prefix):
            return name.removeprefix(prefix)
    return name


class BuiltinEvaluator:
    name = "builtin"

    def __init__(self, functions: Mapping[str, KrmFunction] | None = None) -> None:
        self._functions = dict(FUNCTIONS if functions is None else functions)
        self._lock = threading.Lock()

    def register(self, name: str, function: KrmFunction) -> None:
        """Add a function (e.g. ``fn://NAME`` from a notebook) under exactly `name`."""
        with self._lock:
            self._functions[name] = function

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._functions)

    def _near(self, image: str) -> str:
        """What a mistyped name likely meant (``set-label``: ``set-labels``), or how a notebook
        function is named, as a sentence's end; "" when nothing is near."""
        wanted = image if image.startswith("fn://") else bare_name(image)
        if "/" in wanted.removeprefix("fn://"):  # another registry's: not a typo of ours
            return ""
        near = difflib.get_close_matches(wanted, self.names(), n=1, cutoff=0.75)
        if near:
            return f" (did you mean {near[0]}?)"
        if image.startswith("fn://"):
            return " (fn://NAME is a notebook's `%%function NAME --krm` cell, run first)"
        return ""

    def lookup(self, image: str) -> KrmFunction | None:
        with self._lock:
            if image in self._functions:  # fn://NAME and other exact names
                return self._functions[image]
            name = bare_name(image)
            if "/" in name:  # another registry: not ours
                return None
            return self._functions.get(name)

    def evaluate(self, request: EvalRequest, deadline: float | None = None) -> EvalResponse:
        """Run the function on the request's parsed ResourceList itself when it has one (a
        pipeline's), else on the parsed bytes."""
        function = self.lookup(request.image)
        if function is None:
            raise NotFoundError(
                f"{request.image} is not a builtin function{self._near(request.image)}"
            )
        rl = request.parsed
        if rl is None:
            try:
                rl = ResourceList.parse(request.resource_list)
            except InvalidResourceList as exc:
                raise InvalidEvaluateRequest(
                    f"{request.image}: the input is not a ResourceList: {exc}"
                ) from None
        remaining(deadline)
        try:
            with running(Bounds(), deadline):  # within a pipeline's step, the step's bounds
                function(rl)
            failed = rl.has_errors()
        except FunctionFailure:
            failed = True
        if failed:
            errors = [r for r in rl.results if isinstance(r, dict) and r.get("severity") == ERROR]
            first = errors[0].get("message", "") if errors else "function failure"
            raise FunctionError(
                f"{request.image} failed: {first}",
                exit_code=1,
                stderr="\n".join(
                    line
                    for line in (*rl.stderr, getattr(function, "failure_stderr", FAILURE_STDERR))
                    if line
                ),
                results=[dict(r) for r in rl.results if isinstance(r, dict)],
            )
        log = "\n".join(rl.stderr).encode()
        if request.parsed is not None:
            return EvalResponse(b"", log, self.name, parsed=rl)
        return EvalResponse(rl.to_bytes(), log, self.name)
