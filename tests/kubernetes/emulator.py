"""The emulated Kubernetes API server of the Kubernetes tests — a test double, never part of the
product (docs/kubernetes.md, "What is tested, and with which doubles").

It is KMock's ``KubernetesEmulator`` (PyPI ``kmock``, by Kopf's author), which serves the API's
discovery documents, parses each request into resource, namespace, name and subresource, renders
errors as ``Status`` objects and keeps every object's history in ``objects``. Its object
semantics are simpler than the API server's, and our fences rest on the API server's, so this
subclass serves object requests by these rules of the Kubernetes API instead (each one tested on
its own in tests/kubernetes/test_emulator.py, and listed in docs/kubernetes.md):

1. **resourceVersion**: every write gives the object a new one, from one counter for the whole
   server; a list says the counter's value. ``metadata.uid``, ``creationTimestamp`` and
   ``generation`` are set on create; ``generateName`` is honoured.
2. **Optimistic concurrency**: a PUT, or a PATCH that sets ``metadata.resourceVersion``, or a
   DELETE with ``preconditions``, whose version is not the object's current one is
   ``409 Conflict``; nothing is written.
3. **The status subresource**: a write to ``/status`` changes only ``status``; a write to the
   object itself never changes ``status``; a create drops it.
4. **Label and field selectors** on list and watch (``=``, ``==``, ``!=``, ``in``, ``notin``,
   ``key``, ``!key``; fields by dotted path).
5. **Watch from a resourceVersion**: a watch given one sends every event after it, in order
   (with a selector: an object that comes to match is ``ADDED``, one that stops matching
   ``DELETED``);
   one older than the server keeps is ``410 Expired`` (an ``ERROR`` event); without one, the
   current objects come first as ``ADDED``. ``timeoutSeconds`` ends the stream; with
   ``allowWatchBookmarks=true`` it ends with a ``BOOKMARK`` event at the server's latest
   resourceVersion (as the API server sends one before a watch times out), from which the next
   watch resumes even if none of the watched objects changed meanwhile.
6. **Finalizers**: a DELETE of an object with finalizers sets ``deletionTimestamp``; the write
   that removes the last finalizer deletes it.
7. **Request size**: a request body over 3 MiB (the API server's limit) is ``413``.
10. **Pages**: a list with ``limit`` answers that many items and a ``continue`` token for the
    rest, each page carrying the resourceVersion of the first. Items come in the order of
    their keys (namespace, name), as etcd lists them; the API server serves the pages of one
    list from one snapshot, this double from the objects as they are at each page.
9. **What is stored**: every write records its writer in ``metadata.managedFields`` (the
   ``fieldManager`` parameter, else the client's User-Agent; ``fieldsV1`` names each field the
   write set, a map's keys included), as the API server does; an object whose stored form —
   status and managedFields included — is past etcd's 1.5 MiB is refused as the API server
   refuses it (500, ``etcdserver: request is too large``). A strategic merge patch of a custom
   resource is ``415``, as custom resources do not support it.
8. **Service account tokens and RBAC**: ``POST .../serviceaccounts/NAME/token`` (the
   TokenRequest API, which the kubelet calls for a pod's projected token) gives a token of an
   existing ServiceAccount. A request bearing one is that account's, and is allowed only if a
   RoleBinding of its namespace binds the account to a Role with a rule for the request's verb,
   API group and resource (``runs/status`` for a subresource); otherwise ``403 Forbidden``
   naming them. An unknown token is ``401``. A request with no token is the test's own, an
   administrator's. Every request of an account is recorded, allowed or not, and ``GET
   /emulator/calls`` lists them: which verb of which resource each account used.

11. **Garbage collection**: an object whose ``ownerReferences`` name no object that exists is
    deleted, as the garbage collector deletes it (in the background), when its last owner is
    deleted for good or if it is created so.
12. **ConfigMaps**: one's ``data`` and ``binaryData`` hold at most 1 MiB (``422``); one created
    ``immutable`` refuses a write that changes them or that flag (``422``).

Run as a program it serves on 127.0.0.1 and prints its URL: ``python -m
tests.kubernetes.emulator [--history N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import datetime
import json
import re
import signal
import uuid
from collections import deque
from typing import Any

import aiohttp.test_utils
import aiohttp.web
import jsonpatch
import kmock
from kmock._internal.rendering import Request

from tests.kubernetes.emulator_rbac import Authorizing, _error

MAX_REQUEST_BYTES = 3 * 1024 * 1024
MAX_STORED_BYTES = 1_572_864  # etcd's default request limit (rule 9)
MAX_CONFIG_MAP_BYTES = 1_048_576  # rule 12
_BUILTIN_GROUPS = ("", "apps", "rbac.authorization.k8s.io", "authentication.k8s.io")
_CR_PATCHES = (
    "application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml"
)
_TERM = re.compile(
    r"^\s*(!?)([A-Za-z0-9_./-]+)\s*(?:(==|=|!=)\s*(\S*)|\s+(in|notin)\s*\(([^)]*)\))?\s*$"
)


class Conflict(kmock.KubernetesError):
    pass


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _split_terms(selector: str) -> list[str]:
    """A selector's terms: split at the commas outside parentheses."""
    terms, depth, start = [], 0, 0
    for at, char in enumerate(selector):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            terms.append(selector[start:at])
            start = at + 1
    terms.append(selector[start:])
    return [term for term in terms if term.strip()]


def _field(obj: dict[str, Any], path: str) -> Any:
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def matches(selector: str, values: Any, *, fields: bool = False) -> bool:
    """Whether the labels (or, with `fields`, the object) `values` satisfy `selector`."""
    for term in _split_terms(selector):
        found = _TERM.match(term)
        if found is None:
            raise _error(400, "BadRequest", f"unable to parse requirement: {term!r}")
        negated, key, operator, value, set_operator, members = found.groups()
        have = _field(values, key) if fields else values.get(key)
        have = None if have is None else str(have)
        if operator in ("=", "=="):
            if have != value:
                return False
        elif operator == "!=":
            if have == value:
                return False
        elif set_operator is not None:
            allowed = {member.strip() for member in members.split(",")}
            if (have in allowed) != (set_operator == "in"):
                return False
        elif (have is not None) == bool(negated):  # `key` exists, `!key` does not
            return False
    return True


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (null removes a key)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


class FencedEmulator(Authorizing, kmock.KubernetesEmulator):
    """KMock's emulator with the API rules of the module docstring; `history`: how many events
    a watch can resume from."""

    def __init__(self, *, history: int = 10_000) -> None:
        super().__init__()
        self.revision = 0
        self.events: deque[tuple[int, Any, str | None, dict[str, Any]]] = deque(maxlen=history)
        self._changed: asyncio.Condition | None = None
        self.tokens: dict[str, tuple[str, str]] = {}  # token → (namespace, service account)
        self.calls: list[dict[str, Any]] = []  # each request of an account (rule 8)
        self.closing = False  # serve() is stopping: every watch ends now

    # Dispatch

    async def _handle(self, request: Request) -> aiohttp.web.StreamResponse:
        if request.url.path == "/emulator/calls":
            return aiohttp.web.json_response(self.calls)
        method = request._raw_request.method.upper()  # type: ignore[union-attr]
        account = self._account(request)
        if request.resource is None or request.resource.plural is None:
            return await super()._handle(request)  # discovery: KMock's own
        if account is not None:
            self._authorize(request, method, account)
        elif request.resource.plural == "serviceaccounts" and request.subresource == "token":
            return aiohttp.web.json_response(self._token(request), status=201)
        if len(request.body) > MAX_REQUEST_BYTES:
            raise _error(
                413,
                "RequestEntityTooLarge",
                f"request body of {len(request.body)} bytes; the limit is {MAX_REQUEST_BYTES}",
            )
        if request.name is None:
            if method == "GET" and request.params.get("watch") in ("true", "1"):
                return await self._watch(request)
            if method == "GET":
                return aiohttp.web.json_response(self._list(request))
            if method == "POST":
                return aiohttp.web.json_response(self._create(request), status=201)
        else:
            key = (request.resource, request.namespace, request.name)
            if method == "GET" and request.subresource is None:
                return aiohttp.web.json_response(self._current(key))
            if method in ("PUT", "PATCH"):
                return aiohttp.web.json_response(self._update(request, key, method))
            if method == "DELETE" and request.subresource is None:
                return aiohttp.web.json_response(self._delete(request, key))
        raise _error(405, "MethodNotAllowed", f"{method} is not served on {request.url.path}")

    # Rule 1: versions, and the writes that give them

    def _current(self, key: Any) -> dict[str, Any]:
        if key not in self.objects or self.objects[key].deleted:
            resource, _, name = key
            raise _error(404, "NotFound", f'{resource.plural} "{name}" not found')
        return copy.deepcopy(self.objects[key].raw)

    # Rule 9: what is stored

    @staticmethod
    def _fields(value: Any) -> Any:
        """fieldsV1 of `value`: every key as ``f:KEY``, down to the leaves (metadata's own
        bookkeeping left out)."""
        if isinstance(value, dict):
            return {
                f"f:{k}": FencedEmulator._fields(v)
                for k, v in value.items()
                if k not in ("managedFields", "resourceVersion", "uid", "creationTimestamp",
                             "generation")
            }  # fmt: skip
        return {}

    def _manage(self, request: Request, obj: dict[str, Any], written: dict[str, Any]) -> None:
        """Record in `obj`'s managedFields that this request's writer set `written`."""
        agent = next((v for k, v in request.headers.items() if k.lower() == "user-agent"), "")
        manager = request.params.get("fieldManager") or agent.split("/")[0] or "unknown"
        subresource = request.subresource or ""
        entries = [
            entry for entry in obj["metadata"].get("managedFields") or ()
            if (entry.get("manager"), entry.get("subresource", "")) != (manager, subresource)
        ]  # fmt: skip
        entry = {"manager": manager, "operation": "Update", "apiVersion": obj.get("apiVersion"),
                 "time": _now(), "fieldsType": "FieldsV1", "fieldsV1": self._fields(written)}  # fmt: skip
        if subresource:
            entry["subresource"] = subresource
        obj["metadata"]["managedFields"] = [*entries, entry]

    def _record(self, key: Any, kind: str, obj: dict[str, Any]) -> dict[str, Any]:
        stored = len(json.dumps(obj, ensure_ascii=False).encode())  # UTF-8, as Go writes it
        if kind != "DELETED" and stored > MAX_STORED_BYTES:
            raise _error(500, "InternalError", f"etcdserver: request is too large ({stored} bytes)")
        self.revision += 1
        obj["metadata"]["resourceVersion"] = str(self.revision)
        if kind == "DELETED":
            self.objects[key].delete()
        else:
            self.objects[key].create(copy.deepcopy(obj))
        resource, namespace, _ = key
        self.events.append((self.revision, resource, namespace, {"type": kind, "object": obj}))
        if self._changed is not None:
            changed = self._changed

            async def notify() -> None:
                async with changed:
                    changed.notify_all()

            asyncio.get_running_loop().create_task(notify())
        if kind == "DELETED" or (kind == "ADDED" and obj["metadata"].get("ownerReferences")):
            self._collect()
        return obj

    # Rule 11: garbage collection

    def _collect(self) -> None:
        """Delete every object all of whose owners are gone (each delete collects again)."""
        live = {obj.raw["metadata"]["uid"] for obj in self.objects.values() if not obj.deleted}
        for key, obj in list(self.objects.items()):
            owners = obj.raw["metadata"].get("ownerReferences") if not obj.deleted else None
            if owners and not any(owner.get("uid") in live for owner in owners):
                self._remove(key, copy.deepcopy(obj.raw))
                return  # _record collected the rest

    # Rule 12: ConfigMaps

    @staticmethod
    def _check_config_map(
        resource: Any, new: dict[str, Any], current: dict[str, Any] | None = None
    ) -> None:
        if resource is None or resource.plural != "configmaps":
            return
        size = sum(len(k) + len(str(v).encode()) for field in ("data", "binaryData")
                   for k, v in (new.get(field) or {}).items())  # fmt: skip
        if size > MAX_CONFIG_MAP_BYTES:
            raise _error(422, "Invalid", f"ConfigMap is invalid: []: Too long: must have at "
                         f"most {MAX_CONFIG_MAP_BYTES} bytes")  # fmt: skip
        if (
            current is not None
            and current.get("immutable")
            and any(
                new.get(field) != current.get(field)
                for field in ("data", "binaryData", "immutable")
            )
        ):
            raise _error(422, "Invalid", "ConfigMap is invalid: data: Forbidden: field is "
                         "immutable when `immutable` is set")  # fmt: skip

    def _create(self, request: Request) -> dict[str, Any]:
        body = request.data
        if not isinstance(body, dict):
            raise _error(400, "BadRequest", "the body must be a JSON object")
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if not meta.get("name"):
            raise _error(422, "Invalid", "metadata.name: Required value")
        namespace = request.namespace or meta.get("namespace")
        key = (request.resource, namespace, meta["name"])
        if key in self.objects and not self.objects[key].deleted:
            raise _error(
                409, "AlreadyExists", f'{request.resource.plural} "{meta["name"]}" already exists'
            )
        if namespace is not None:
            meta["namespace"] = namespace
        self._check_config_map(request.resource, obj)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1)
        meta.pop("deletionTimestamp", None)
        meta.pop("managedFields", None)
        obj.pop("status", None)  # rule 3
        self._manage(
            request, obj, {k: v for k, v in obj.items() if k not in ("apiVersion", "kind")}
        )
        if key not in self.objects:
            self.objects[key] = {}
            del self.objects[key].history[:]
        return self._record(key, "ADDED", obj)

    # Rules 2, 3 and 6

    def _update(self, request: Request, key: Any, method: str) -> dict[str, Any]:
        current = self._current(key)
        body = request.data
        if method == "PATCH":
            content_type = request.headers.get("Content-Type", "")
            group = request.resource.group if request.resource is not None else ""
            if "strategic-merge-patch" in content_type and group not in _BUILTIN_GROUPS:
                raise _error(415, "UnsupportedMediaType", "the body of the request was in an "
                             f"unknown format - accepted media types include: {_CR_PATCHES}")  # fmt: skip
            if "json-patch" in content_type:
                try:
                    wanted = jsonpatch.apply_patch(current, body)
                except (jsonpatch.JsonPatchException, TypeError) as exc:
                    raise _error(422, "Invalid", f"the JSON patch does not apply: {exc}") from None
            else:  # merge patch; a strategic merge patch is read as one (lists replaced whole)
                wanted = merge_patch(current, body)
            expected = (
                ((body or {}).get("metadata") or {}).get("resourceVersion")
                if isinstance(body, dict)
                else None
            )
        else:
            if not isinstance(body, dict):
                raise _error(400, "BadRequest", "the body must be a JSON object")
            wanted = body
            expected = (body.get("metadata") or {}).get("resourceVersion")
        if expected and expected != current["metadata"]["resourceVersion"]:
            resource, _, name = key
            raise Conflict(
                status=409,
                reason="Conflict",
                message=(
                    f'Operation cannot be fulfilled on {resource.plural} "{name}": the object has '
                    "been modified; please apply your changes to the latest version and try again"
                ),
                details={},
            )
        if request.subresource == "status":
            new = copy.deepcopy(current)
            if wanted.get("status") is None:
                new.pop("status", None)
            else:
                new["status"] = copy.deepcopy(wanted["status"])
        elif request.subresource is None:
            new = copy.deepcopy(wanted)
            kept = {k: current["metadata"][k] for k in ("uid", "creationTimestamp", "namespace",
                                                         "name", "deletionTimestamp", "generation")
                    if k in current["metadata"]}  # fmt: skip
            new.setdefault("metadata", {}).update(kept)
            if "status" in current:
                new["status"] = current["status"]
            else:
                new.pop("status", None)
            if new.get("spec") != current.get("spec"):
                new["metadata"]["generation"] = current["metadata"].get("generation", 1) + 1
        else:
            raise _error(404, "NotFound", f"no subresource {request.subresource!r} here")
        self._check_config_map(request.resource, new, current)
        new["metadata"]["managedFields"] = current["metadata"].get("managedFields") or []
        written = ({"status": new.get("status")} if request.subresource == "status" else
                   {k: v for k, v in new.items() if k not in ("apiVersion", "kind", "status")})  # fmt: skip
        self._manage(request, new, written)
        meta = new["metadata"]
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            return self._record(key, "DELETED", new)
        return self._record(key, "MODIFIED", new)

    def _delete(self, request: Request, key: Any) -> dict[str, Any]:
        current = self._current(key)
        options = request.data if isinstance(request.data, dict) else {}
        preconditions = options.get("preconditions") or {}
        for field in ("resourceVersion", "uid"):
            wanted = preconditions.get(field)
            if wanted and wanted != current["metadata"].get(field):
                raise _error(409, "Conflict", f"precondition failed: {field} is not {wanted}")
        return self._remove(key, current)

    def _remove(self, key: Any, current: dict[str, Any]) -> dict[str, Any]:
        """Delete the object: at once, or (rule 6) once its finalizers are removed."""
        if current["metadata"].get("finalizers"):
            if current["metadata"].get("deletionTimestamp"):
                return current
            current["metadata"]["deletionTimestamp"] = _now()
            return self._record(key, "MODIFIED", current)
        return self._record(key, "DELETED", current)

    # Rules 4 and 5

    def _as_watched(
        self, request: Request, resource: Any, namespace: str | None, revision: int,
        event: dict[str, Any],
    ) -> dict[str, Any] | None:  # fmt: skip
        """`event` as a watch with a selector sees it: an object that comes to match is
        ADDED, one that stops matching DELETED (as the API server sends them), one that
        neither matches nor matched is not sent."""
        obj = event["object"]
        now = self._selected(request, resource, namespace, obj)
        before = self._matched_before(request, obj["metadata"].get("uid"), revision)
        if event["type"] == "DELETED":
            return event if now or before else None
        if now:
            return event if before else {"type": "ADDED", "object": obj}
        return {"type": "DELETED", "object": obj} if before else None

    def _matched_before(self, request: Request, uid: str | None, revision: int) -> bool:
        """Whether the object `uid`, as it was before `revision`, matched the request's
        selectors (as far back as the history keeps)."""
        for earlier, resource, namespace, event in reversed(self.events):
            if earlier < revision and event["object"]["metadata"].get("uid") == uid:
                return event["type"] != "DELETED" and self._selected(
                    request, resource, namespace, event["object"]
                )
        return False

    def _selected(self, request: Request, resource: Any, namespace: str | None, obj: Any) -> bool:
        if resource != request.resource:
            return False
        if request.namespace is not None and namespace != request.namespace:
            return False
        labels = (obj.get("metadata") or {}).get("labels") or {}
        label_selector = request.params.get("labelSelector", "")
        field_selector = request.params.get("fieldSelector", "")
        return matches(label_selector, labels) and matches(field_selector, obj, fields=True)

    def _list(self, request: Request) -> dict[str, Any]:
        items = [
            copy.deepcopy(obj.raw)
            for (resource, namespace, _), obj in self.objects.items()
            if not obj.deleted and self._selected(request, resource, namespace, obj.raw)
        ]
        # In the order of their keys, as etcd lists them: a page's offset stays put however
        # the objects change between pages.
        items.sort(
            key=lambda item: (item["metadata"].get("namespace") or "", item["metadata"]["name"])
        )
        metadata = {"resourceVersion": str(self.revision)}
        # Pages (rule 10): `limit` items from `continue`'s offset, the list's resourceVersion
        # the one its first page had.
        start, _, version = request.params.get("continue", "").partition(":")
        if version:
            metadata["resourceVersion"] = version
        limit = int(request.params.get("limit") or 0)
        offset = int(start or 0)
        if limit:
            if offset + limit < len(items):
                metadata["continue"] = f"{offset + limit}:{metadata['resourceVersion']}"
            items = items[offset : offset + limit]
        return {"apiVersion": "v1", "kind": "List", "metadata": metadata, "items": items}

    async def _watch(self, request: Request) -> aiohttp.web.StreamResponse:
        if self._changed is None:
            self._changed = asyncio.Condition()
        since = request.params.get("resourceVersion", "")
        timeout = float(request.params.get("timeoutSeconds") or 1800)
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request._raw_request)  # type: ignore[arg-type]

        async def send(event: dict[str, Any]) -> None:
            await response.write(json.dumps(event).encode() + b"\n")

        oldest = self.events[0][0] if self.events else self.revision + 1
        if since in ("", "0"):
            cursor = self.revision
            for item in self._list(request)["items"]:
                await send({"type": "ADDED", "object": item})
        elif int(since) < oldest - 1 and int(since) < self.revision:
            await send({"type": "ERROR", "object": {
                "apiVersion": "v1", "kind": "Status", "status": "Failure", "code": 410,
                "reason": "Expired", "message": f"too old resource version: {since} ({oldest})",
            }})  # fmt: skip
            await response.write_eof()
            return response
        else:
            cursor = int(since)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        with contextlib.suppress(ConnectionResetError, asyncio.CancelledError):
            while loop.time() < deadline and not self.closing:
                fresh = []
                for item in reversed(self.events):  # the newest first, back to the cursor
                    if item[0] <= cursor:
                        break
                    fresh.append(item)
                for revision, resource, namespace, event in reversed(fresh):
                    cursor = revision
                    seen = self._as_watched(request, resource, namespace, revision, event)
                    if seen is not None:
                        await send(seen)
                async with self._changed:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(
                            self._changed.wait(), max(0.0, min(1.0, deadline - loop.time()))
                        )
            if request.params.get("allowWatchBookmarks") in ("true", "1"):
                await send({"type": "BOOKMARK", "object": {
                    "metadata": {"resourceVersion": str(cursor)},
                }})  # fmt: skip
            await response.write_eof()
        return response


class _TakingLargeBodies(aiohttp.test_utils.RawTestServer):
    """aiohttp's raw server, reading a body of up to the API server's request limit (its own
    default is 1 MiB, which would refuse a request the API server takes)."""

    async def _make_runner(self, debug: bool = True, **kwargs: Any) -> aiohttp.web.ServerRunner:
        server = aiohttp.web.Server(self._handler, loop=self._loop, debug=debug, **kwargs)

        def request(*args: Any) -> aiohttp.web.BaseRequest:
            return aiohttp.web.BaseRequest(*args, server._loop,  # type: ignore[misc]
                                           client_max_size=2 * MAX_REQUEST_BYTES)  # fmt: skip

        server.request_factory = request  # type: ignore[assignment]
        return aiohttp.web.ServerRunner(server, debug=debug, **kwargs)


async def serve(host: str = "127.0.0.1", history: int = 10_000) -> None:
    emulator = FencedEmulator(history=history)
    async with emulator, kmock.Server(emulator, host=host, server_cls=_TakingLargeBodies) as server:
        print(f"emulated Kubernetes API at {server.url}".rstrip("/"), flush=True)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
        # End the watches, which would hold the server's shutdown until their timeout.
        emulator.closing = True
        if emulator._changed is not None:
            async with emulator._changed:
                emulator._changed.notify_all()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m tests.kubernetes.emulator")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument(
        "--history", type=int, default=10_000, help="events a watch can resume from"
    )
    args = parser.parse_args()
    asyncio.run(serve(args.host, args.history))
