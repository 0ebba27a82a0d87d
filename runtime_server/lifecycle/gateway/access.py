"""Who may call the gateway (README, "Security"): the checks every request passes before anything
is looked up or called — header size, Host (DNS rebinding), Origin (CORS), the bearer token and,
for a body, its Content-Type.
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
from dataclasses import dataclass

from tornado import httputil

from fnkernel.adapters._payloads import JSON
from fnkernel.runtime_server import wire
from fnkernel.runtime_server.lifecycle.gateway.failures import FailureResponse

MAX_HEADER_BYTES = 64 * 1024  # larger request headers get 431
EXPOSED_HEADERS = ", ".join(
    (
        wire.INVOCATION_ID_HEADER,
        wire.OUTPUTS_HEADER,
        wire.ATTEMPT_HEADER,
        wire.COLD_START_HEADER,
        wire.LOGS_HEADER,
        wire.TIMELINE_HEADER,
        wire.RUN_HEADER,
        wire.SPANS_HEADER,
        "Retry-After",
    )
)
ALLOWED_REQUEST_HEADERS = ", ".join(
    (
        "Authorization",
        "Content-Type",
        wire.INVOCATION_ID_HEADER,
        wire.TIMEOUT_HEADER,
        wire.TIMELINE_HEADER,
        wire.RUN_UID_HEADER,
        wire.TRACEPARENT_HEADER,
    )
)


@dataclass(frozen=True)
class Access:
    """Who may call the gateway (README, "Security"): the bearer token (None: no token, which
    the CLI allows on loopback only), the browser origins allowed (none by default), and the
    host names the Host header may carry besides the listen address and ``localhost``."""

    token: str | None = None
    allowed_origins: frozenset[str] = frozenset()
    allowed_hosts: frozenset[str] = frozenset()

    def token_matches(self, authorization: str) -> bool:
        if self.token is None:
            return True
        scheme, _, credentials = authorization.strip().partition(" ")
        # RFC 9110 §11.1: the scheme is case-insensitive.
        return scheme.lower() == "bearer" and hmac.compare_digest(
            credentials.strip().encode(), self.token.encode()
        )

    def host_allowed(self, host: str, listen_host: str) -> bool:
        """DNS rebinding: a page served from evil.example that resolves to 127.0.0.1 reaches
        us with ``Host: evil.example``; only our own names and addresses are answered."""
        return _host_allowed(host, listen_host, self.allowed_hosts)


@functools.lru_cache(maxsize=256)
def _host_allowed(host: str, listen_host: str, allowed_hosts: frozenset[str]) -> bool:
    """``Access.host_allowed``, remembered: every request asks, a client sends the same Host each
    time, and parsing two addresses cost ~14 us a request (warm). The cache is bounded, so a
    client sending ever new Hosts only misses it."""
    name = _host_name(host)
    if name == "localhost" or name in allowed_hosts:
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    if listen_host in ("", "0.0.0.0", "::"):
        return True  # bound to every address: any of ours may be named
    if listen_host == "localhost":
        return address.is_loopback
    try:
        bound = ipaddress.ip_address(listen_host)
    except ValueError:
        return False
    return address == bound or (address.is_loopback and bound.is_loopback)


def _host_name(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def check_origin(
    request: httputil.HTTPServerRequest, access: Access, listen_host: str
) -> str | None:
    """The checks that come before the token: the headers' size (431), the Host (403) and the
    Origin (403 unless allowed). The allowed Origin the answer must name (CORS), if any."""
    size = len(request.method or "") + len(request.uri or "")
    size += sum(len(k) + len(v) + 4 for k, v in request.headers.get_all())
    if size > MAX_HEADER_BYTES:
        raise FailureResponse(
            "REQUEST_HEADER_FIELDS_TOO_LARGE",
            status=431,
            message=f"request headers are {size} bytes; at most {MAX_HEADER_BYTES}",
        )
    if not access.host_allowed(request.host, listen_host):
        raise FailureResponse("PERMISSION_DENIED", f"Host {request.host[:100]!r} is not allowed")
    origin = request.headers.get("Origin")
    if origin is not None and origin not in access.allowed_origins:
        raise FailureResponse("PERMISSION_DENIED", f"Origin {origin[:100]!r} is not allowed")
    return origin


def check_credentials(
    request: httputil.HTTPServerRequest,
    access: Access,
    bodies: tuple[str, ...] | None = (JSON,),
) -> None:
    """The bearer token (401), and a body's Content-Type, one of its route's `bodies` (415): a
    browser sends text/plain and form bodies cross-origin without asking first, and asks
    first (a CORS preflight) for any other type. Not for a preflight, which carries no
    token. `bodies` None: the route does not take the request's method (its answer is 405),
    so no body of it is read."""
    if not access.token_matches(request.headers.get("Authorization", "")):
        raise FailureResponse("UNAUTHENTICATED", "missing or wrong bearer token")
    if bodies is not None and request.method in ("POST", "PUT", "PATCH"):
        why = wire.unsupported_media(request.headers.get("Content-Type", ""), bodies)
        if why is not None:
            raise FailureResponse("UNSUPPORTED_MEDIA_TYPE", status=415, message=why)


def accepts(accept: str, media_type: str) -> bool:
    """Whether an Accept header takes `media_type`: the most specific range that matches it
    (itself, then its type's ``type/*``, then ``*/*``) does, at a weight above ``q=0``; no
    header takes anything (RFC 9110, section 12.5.1)."""
    if not accept.strip():
        return True
    kind = media_type.split("/", 1)[0]
    specificity = {media_type: 3, f"{kind}/*": 2, "*/*": 1}
    best, taken = 0, False
    for entry in accept.split(","):
        media_range, *params = (part.strip().lower() for part in entry.split(";"))
        rank = specificity.get(media_range, 0)
        if rank > best:
            refused = any(
                param.replace(" ", "") in ("q=0", "q=0.0", "q=0.00", "q=0.000") for param in params
            )
            best, taken = rank, not refused
    return taken
