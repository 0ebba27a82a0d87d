"""The informer (docs/kubernetes.md, "Reads"): a cache of one kind of object of a namespace,
filled by a list and kept current by a watch resumed from the last resourceVersion seen, listed
again when the server says it expired (410) — the pattern of Kubernetes' own controllers. The
Run store keeps one of its Runs and one of the Runtime Pods (``store.KubernetesRunStore``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import kubernetes.watch.watch
from kubernetes.client.exceptions import ApiException

LOG = logging.getLogger("fnkernel.kubernetes")
WATCH_SECONDS = 60  # how long one watch request lasts before it is made again (server side)
_RETRY_SECONDS = 1.0  # after a failed list or watch
_TOMBSTONES = 10_000  # deleted objects an informer remembers (see Informer.learn)
_LIST_PAGE = 50  # objects a list reads at once (a Run may be 1.5 MiB)


def raw_answer(response: object) -> Any:
    """The JSON of a call made with ``_preload_content=False`` (the client's hints name the
    model it would have built)."""
    return json.loads(getattr(response, "data"))  # noqa: B009 — the hints do not know it


def object_of(answer: object) -> dict[str, Any]:
    """An object as the client's custom-object calls answer it: a dict."""
    if not isinstance(answer, dict):
        raise TypeError(f"the API server answered {type(answer).__name__}, not an object")
    return answer


def _revision(obj: Mapping[str, Any]) -> int:
    text = str((obj.get("metadata") or {}).get("resourceVersion", ""))
    return int(text) if text.isdigit() else -1


class Informer:
    """One kind of object of the namespace, listed then watched, in a thread of its own."""

    def __init__(
        self,
        name: str,
        list_call: Callable[..., Any],
        on_change: Callable[[], None],
        stop: threading.Event,
        keep: Callable[[dict[str, Any]], dict[str, Any]] = lambda obj: obj,
        **selectors: Any,
    ) -> None:
        """`keep`: what of each object the cache holds (the Runs' without their files)."""
        self.name = name
        self._keep = keep
        self._list_call = list_call
        self._selectors = selectors
        self._on_change = on_change
        self._stop = stop
        self._lock = threading.Lock()
        self.items: dict[str, dict[str, Any]] = {}  # by metadata.uid
        # uid → the resourceVersion it was deleted at, for the last _TOMBSTONES deleted.
        self._gone: OrderedDict[str, int] = OrderedDict()
        self.synced = threading.Event()
        self._response: Any = None  # the watch request being read
        self._thread = threading.Thread(target=self._run, name=f"watch {name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        response = self._response
        if response is not None:
            # The watch thread's read ends now — unless the request ended meanwhile, and its
            # socket was closed or released (urllib3 then refuses, as a closed socket does).
            with contextlib.suppress(OSError, ValueError, RuntimeError):
                response.shutdown()

    def learn(self, obj: dict[str, Any], *, deleted: bool = False) -> None:
        """Put what a write of ours answered (or a watch event) in the cache, unless the cache
        already holds a newer version of it — or knows it deleted at that version or later: a
        watch event of an older write, arriving after our own delete, must not bring it back."""
        obj = self._keep(obj)
        uid = obj["metadata"]["uid"]
        revision = _revision(obj)
        with self._lock:
            held = self.items.get(uid)
            if held is not None and _revision(held) > revision >= 0:
                return
            if deleted:
                self.items.pop(uid, None)
                self._gone[uid] = max(
                    revision, _revision(held) if held else -1, self._gone.get(uid, -1)
                )
                while len(self._gone) > _TOMBSTONES:
                    self._gone.popitem(last=False)
            elif uid in self._gone and revision <= self._gone[uid]:
                return
            else:
                self.items[uid] = obj
        self._on_change()

    def snapshot(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.items.values())

    def get(self, uid: str) -> dict[str, Any] | None:
        with self._lock:
            return self.items.get(uid)

    def _list(self) -> str:
        """List in pages of _LIST_PAGE, keeping what `keep` keeps of each item as it comes:
        the whole list of large objects is never in memory at once (docs/kubernetes.md,
        "Reads"). The resourceVersion the watch resumes from."""
        items: dict[str, dict[str, Any]] = {}
        token = ""
        while True:
            page = raw_answer(self._list_call(
                _preload_content=False, limit=_LIST_PAGE, **({"_continue": token} if token else {}),
                **self._selectors,
            ))  # fmt: skip
            for item in page.get("items") or ():
                items[item["metadata"]["uid"]] = self._keep(item)
            token = str(page["metadata"].get("continue") or "")
            if not token:
                break
        with self._lock:
            self.items = items
        self.synced.set()
        self._on_change()
        return str(page["metadata"].get("resourceVersion", ""))

    def _run(self) -> None:
        since = ""
        while not self._stop.is_set():
            try:
                if not since:
                    since = self._list()
                since = self._follow(since)
            except _Expired:  # the server no longer keeps `since`: list again, at once
                LOG.info("watch of %s expired; listing again", self.name)
                since = ""
            except Exception as exc:  # the API server is away: list again once it is back
                if self._stop.is_set():
                    return
                LOG.warning("watch of %s failed: %s; again in %ss", self.name, exc, _RETRY_SECONDS)
                since = ""
                self._stop.wait(_RETRY_SECONDS)

    def _follow(self, since: str) -> str:
        """One watch request from resourceVersion `since`, until the server ends it; the last
        resourceVersion seen. The events are read here, not by the client's ``Watch``, which
        cannot read an ERROR event it did not deserialize: a 410 is ``_Expired``, and BOOKMARK
        events (asked for) keep `since` current while no object of ours changes, so a quiet
        watch resumes where the server still is instead of expiring."""
        response = self._list_call(
            watch=True,
            resource_version=since,
            timeout_seconds=WATCH_SECONDS,
            allow_watch_bookmarks=True,
            _preload_content=False,
            **self._selectors,
        )
        self._response = response
        try:
            for line in kubernetes.watch.watch.iter_resp_lines(response):
                event = json.loads(line)
                obj = event["object"]
                if event["type"] == "ERROR":
                    if obj.get("code") == 410:
                        raise _Expired(str(obj.get("message", "")))
                    raise ApiException(status=obj.get("code"), reason=obj.get("message"))
                if event["type"] != "BOOKMARK":
                    self.learn(obj, deleted=event["type"] == "DELETED")
                since = obj["metadata"]["resourceVersion"]
                if self._stop.is_set():
                    break
        finally:
            self._response = None
            response.release_conn()
        return since


class _Expired(Exception):
    """The watch's resourceVersion is older than the API server keeps (410 Gone)."""
