"""A client on the stack's own machine (docs/protocol.md, "Large payloads", "Calling runtimed
directly", "Batches"): the stack's spool, where payloads and results are handed over as files,
and the routes to its runtimeds — and what the client trusts of them (README, "Security"): a
spool its gateway file names, or a gateway's on a Unix socket of this user's alone; a result's
name only, never through a link; a runtimed on a Unix socket of this user's alone.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from fnkernel.runtime_server import limits, wire
from fnkernel.runtime_server.client.errors import GatewayError, GatewayUnreachable
from fnkernel.runtime_server.client.transport import Headers, Transport, quote
from fnkernel.system.private import check_private_dir


class Local(Transport):
    """What a client does with the stack of its own machine: its spool and its runtimeds."""

    def _lanes(self, name: str, run_uid: str = "") -> list[Any] | None:
        """The routes of a map's batches (docs/protocol.md, "Batches"): the Run's own, or each
        replica's of a replica set (``_route``), when this client may call them directly (and
        the Run is the one of `run_uid`, if given: a kept route that is not asks again); else
        None."""
        if not self._direct_allowed() or self.local_spool() is None:
            return None
        try:
            lanes = self._route(name)
            if lanes and not meant(lanes, name, run_uid):
                self.forget_routes(name)
                lanes = self._route(name)
        except GatewayError:
            return None  # the map's first call says why
        if not lanes or not meant(lanes, name, run_uid):
            return None  # not the Run the map is meant for: its calls say so, by the gateway
        return lanes

    def picked(self, name: str, routes: list[Any]) -> list[Any]:
        """`routes` in the order to try them for one call of `name`: a replica set's by the
        fewest of this client's calls in flight on each, round robin among equals, as the
        gateway picks (docs/protocol.md, "Replicas")."""
        if len(routes) == 1:
            return routes
        with self._lock:
            turn = self._turns[name] % len(routes)
            self._turns[name] += 1
            turned = routes[turn:] + routes[:turn]
            return sorted(turned, key=lambda route: self._calls_on[route.run_uid])

    @contextlib.contextmanager
    def calling(self, route: Any) -> Iterator[None]:
        """Count a call of this client's in flight on `route`'s Run while the block runs."""
        with self._lock:
            self._calls_on[route.run_uid] += 1
        try:
            yield
        finally:
            with self._lock:
                self._calls_on[route.run_uid] -= 1
                if not self._calls_on[route.run_uid]:
                    del self._calls_on[route.run_uid]

    def _called_directly(
        self,
        name: str,
        routes: list[Any],
        body: bytes,
        headers: dict[str, str],
        timeout_millis: int,
        live: Any,  # a LiveFollow
    ) -> tuple[Headers, bytes] | None:
        """The call on runtimed directly: on its Run, or on a replica set's replicas in turn
        (``picked``), the next when one is busy with another caller's call, as the gateway
        picks (docs/protocol.md, "Replicas"); None to make it through the gateway: its route
        has gone (never ran there), or every replica is busy (the gateway's answer says so)."""
        from fnkernel.runtime_server.client.direct import RouteGone

        wait = limits.wait_seconds(timeout_millis, hops_below=1)
        replicas = len(routes) > 1
        for route in self.picked(name, routes):
            if live is not None and replicas:
                live.at(route.name)  # followed where it runs
            try:
                with self.calling(route):
                    reply, output = self._runtimeds().invoke(route, body, headers, wait)
            except RouteGone:
                self.forget_routes(name)  # never ran there: learn it again, via the gateway
                break
            except GatewayError as refused:
                if not replicas or refused.code != "RESOURCE_EXHAUSTED":
                    raise
                continue  # that replica is busy with another caller's call: the next
            if replicas:
                reply[wire.RUN_HEADER] = route.name  # as the gateway names the one that served
            return reply, output
        if live is not None and replicas:
            live.at(name)  # through the gateway, which knows where it sends the call
        return None

    def forget_routes(self, name: str) -> None:
        """A call or a batch of `name` was refused before it ran (its route no longer leads to
        its Run, which moved or was made again; or another caller's call held it): the next
        call asks for the routes again."""
        self._routes.pop(name, None)

    def batch(
        self,
        lane: Any,
        items: Sequence[tuple[str, bytes, str]],
        *,
        timeout_millis: int,
        go_on: bool,
        most: int,
        refill_at: int,
        last: bool,
    ) -> Any:
        """Each of `items` (invocation ID, input, content type) called in turn on the route
        `lane` (``_lanes``), as one batch, which may be sent up to `most` items in all (none
        more if `last`): a ``direct.BatchCall``, whose ``answers`` give each result or failure
        by its item's index as it comes."""
        wait = limits.wait_seconds(timeout_millis, hops_below=1) * most
        return self._runtimeds().invoke_batch(
            lane, items, timeout_millis, go_on, wait, refill_at, last
        )

    def _direct_allowed(self) -> bool:
        """Whether calls may skip the gateway (a subclass that records every request says no
        while it records)."""
        return True

    def _route(self, name: str) -> list[Any]:
        """The routes of `name`'s calls on this machine (``direct.Route``): its Run's, or each
        replica's of a replica set; none to call through the gateway. Asked of the gateway once,
        then kept until one fails (``forget_routes``), or while the gateway says why there are
        none for good."""
        if name in self._routes:
            return self._routes[name]
        from fnkernel.runtime_server.client.direct import Route

        answer = self._json("GET", f"/v1/runs/{quote(name)}:route")
        found, replicas = answer.get("route"), answer.get("replicas") or []
        routes = [Route.of(name, found)] if found else [Route.of(r["name"], r) for r in replicas]
        if not all(_private_socket(route.address) for route in routes):
            routes = []  # a runtimed only this user can be listening for, or the gateway
        if routes or answer.get("lasting"):
            self._routes[name] = routes
        return routes

    def _runtimeds(self) -> Any:
        if self._direct is None:
            from fnkernel.runtime_server.client.direct import Direct

            owner = self.channels_from
            self._direct = Direct(owner._runtimeds() if owner is not None else None)
        return self._direct

    def local_spool(self) -> Path | None:
        """The spool the gateway's pods share, if this process can hand payloads over there
        (``_local``): asked of the gateway (``GET /v1/payloads``) once, when a call first has a
        large payload, or learnt from a large result's answer. GatewayUnreachable if no
        gateway answers (asked again next time): before a large payload is read whole to be
        sent where it cannot go."""
        if self._spool is None:
            named = None
            try:
                bounds = self._json("GET", "/v1/payloads")
                named, self._max_payload = bounds["spool"], int(bounds["maxBytes"])
            except GatewayUnreachable:
                raise
            except (GatewayError, ValueError, KeyError, TypeError):
                pass  # a gateway that does not say: calls go through it, every byte in them
            self._spool = (self._vouched_spool(named) if named else None,)
        return self._spool[0]

    def _vouched_spool(self, named: str) -> Path | None:
        """The spool a gateway names (``GET /v1/payloads``, ``X-Fn-Spool``), if it is this
        machine's stack's, this user's and 0700 (``_local``): named by the gateway this
        machine's gateway file announces, which the server answering is (``tokens.holds``), or
        by one on a Unix socket of this user's alone. Any other server at the address — there
        when the stack is not, or another user's — could name any directory of this user's,
        whose files the client would then read as results, and free."""
        if not (named == self.announced_spool or _private_socket(self.address)):
            return None
        return _local(named)

    def _spool_known(self) -> Path | None:
        return self._spool[0] if self._spool is not None else None


def _local(named: str) -> Path | None:
    """The spool directory `named`, if it is on this machine, this user's and 0700: not, say, a
    path a gateway on another machine names."""
    try:
        seen = os.stat(named)
    except (OSError, ValueError):
        return None
    mine = seen.st_uid == os.getuid() and stat.S_IMODE(seen.st_mode) == 0o700
    return Path(named) if mine and stat.S_ISDIR(seen.st_mode) else None


# A result's name in the spool (function_runtime/spool.py, new_name): nothing else is read.
_RESULT_NAME = re.compile(r"out-[A-Za-z0-9_-]{22}")


def result_in(spool: Path, ref: str) -> Path:
    """The spooled result an answer's X-Fn-Output-Ref names: a result's name, a file of this
    user's, never a link; GatewayError (not read, not freed) for any other."""
    name = ref.split(" ", 1)[0]
    path = spool / name
    try:
        seen = os.lstat(path) if _RESULT_NAME.fullmatch(name) else None
    except OSError:
        seen = None
    if seen is None or not stat.S_ISREG(seen.st_mode) or seen.st_uid != os.getuid():
        raise GatewayError(f"the answer names no result of the spool ({name!r}); not read")
    return path


def meant(lanes: list[Any], name: str, run_uid: str) -> bool:
    """Whether `lanes` are those of the Run of `run_uid` (any, if none is given)."""
    return not run_uid or any(lane.name == name and lane.run_uid == run_uid for lane in lanes)


def _private_socket(address: str) -> bool:
    """Whether `address` is a Unix socket in a directory of this user's alone: only a process
    of this user's can be listening there."""
    if not address.startswith("unix:"):
        return False
    try:
        check_private_dir(Path(address[5:]).parent)
    except OSError:
        return False
    return True
