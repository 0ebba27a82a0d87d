"""The gateway's bearer token: made, stored, announced and found (README, "Security").

Standard library only (and system.procfs, system.private): the client library, and so the
kernel, imports this at start.

* A gateway on TCP requires a token, loopback included, because any web page the user opens can
  send requests to loopback. When none is given, one is generated at start and stored in
  ``STATE_DIR/token`` (mode 0600).
* Every gateway for this machine's clients on TCP also writes a *gateway file*
  ``gateway-PID.json`` ({address, token, spool, pid}, mode 0600) into the runtime directory
  (0700), and removes it when it stops, as Jupyter Server does with its ``jpserver-PID.json``.
  A client given only an address finds the token there, so neither the CLI nor the kernel
  makes the user copy it; and what the file says is what the client trusts of the gateway —
  its spool, where payloads are handed over — once the server it connected to is the one the
  file names (``holds``: another local user may listen on another loopback address at the same
  port). A gateway that was killed cannot remove its file: the next gateway to announce itself,
  or client to look, removes every file whose process is gone.
* Both directories must be this user's alone (``system.private``): a token is never written
  into, nor read from, a directory another user made or may write.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import socket
import stat
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fnkernel.system.private import check_private_dir, create_private, private_dir
from fnkernel.system.procfs import running

TOKEN_ENV = "FNKERNEL_TOKEN"
RUNTIME_DIR_ENV = "FNKERNEL_RUNTIME_DIR"
TOKEN_FILE = "token"  # inside the state dir


def generate() -> str:
    """A fresh token: 256 random bits, URL-safe."""
    return secrets.token_urlsafe(32)


def write_private(path: Path, text: str) -> Path:
    """Write `text` to `path`, readable by this user only (0600), replacing it whole: through a
    new temporary file (O_EXCL) in a directory that is this user's alone (NotPrivate otherwise),
    which is removed again if the write fails (a full disk)."""
    private_dir(path.parent)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = create_private(temporary)
    try:
        try:
            view = memoryview(text.encode())
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return path


def read_token_file(path: Path) -> str:
    """The token in `path`, a ``--token-file``; ValueError naming the flag if it cannot be
    read, holds none (never quoting what it holds), or every user of the machine may read it
    (its group may: a Kubernetes Secret's volume is shared with the pod's fsGroup)."""
    try:
        token = path.read_text().strip()
        mode = path.stat().st_mode
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not text"
        raise ValueError(f"--token-file {path}: cannot be read: {why}") from None
    if mode & stat.S_IROTH:
        raise ValueError(
            f"--token-file {path}: every user of this machine may read it (mode "
            f"{stat.S_IMODE(mode):04o}), and with it run code as you: chmod o-r it"
        )
    if not token or not token.isprintable() or any(c.isspace() for c in token):
        raise ValueError(f"--token-file {path}: does not hold a token (one line, no spaces)")
    return token


def is_loopback(listen: str) -> bool:
    """Whether a listen address (``host:port`` or ``unix:PATH``) is reachable from this machine
    only."""
    if listen.startswith("unix:"):
        return True
    return _is_local(listen.rpartition(":")[0].strip("[]").lower())


@dataclass(frozen=True)
class GatewayToken:
    """What a gateway about to listen on `listen` requires: `token` (None: none) and the file
    that holds it (given, or generated into the state dir)."""

    token: str | None
    path: Path | None = None
    generated: bool = False


def gateway_token(
    listen: str, state_dir: Path, *, token_file: Path | None = None, no_token: bool = False
) -> GatewayToken:
    """README, "Security": a token on every TCP listener, loopback included — the one in
    `token_file`, or a new one stored in STATE_DIR/token; none on a Unix socket (its file mode
    guards it) or with `no_token` on loopback. ValueError for any other combination."""
    if no_token and token_file is not None:
        raise ValueError("--no-token and --token-file exclude each other")
    if token_file is not None:
        return GatewayToken(read_token_file(token_file), token_file)
    if listen.startswith("unix:"):
        return GatewayToken(None)
    if no_token:
        if not is_loopback(listen):
            raise ValueError(
                f"refusing to listen on {listen} without a token "
                "(--no-token is for loopback addresses only)"
            )
        return GatewayToken(None)
    token = generate()
    path = write_private(state_dir / TOKEN_FILE, token + "\n")
    return GatewayToken(token, path, generated=True)


def runtime_dir() -> Path:
    """Where running gateways leave their gateway files."""
    explicit = os.environ.get(RUNTIME_DIR_ENV)
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "fnkernel"
    return Path.home() / ".local" / "share" / "fnkernel" / "runtime"


def announce(address: str, token: str | None, spool: str | None = None) -> Path:
    """Write this process's gateway file; remove it with ``withdraw``. NotPrivate if the runtime
    dir is not this user's alone."""
    directory = private_dir(runtime_dir())
    _gateway_files(directory)  # removes those of gateways that are gone
    body = {"address": address, "token": token, "spool": spool, "pid": os.getpid()}
    return write_private(directory / f"gateway-{os.getpid()}.json", json.dumps(body))


def withdraw(path: Path) -> None:
    path.unlink(missing_ok=True)


def _endpoint(address: str) -> tuple[str, int | None]:
    url = urllib.parse.urlsplit(address if "://" in address else f"http://{address}")
    try:
        port = url.port
    except ValueError:
        port = None
    return (url.hostname or "").lower(), port


def _is_local(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def same_gateway(announced: str, wanted: str) -> bool:
    """Whether a client that was given `wanted` talks to the gateway that announced itself at
    `announced`. A loopback name matches a gateway bound to loopback or to every address; no
    other host gets a token meant for another."""
    host, port = _endpoint(announced)
    want_host, want_port = _endpoint(wanted)
    if port is None or port != want_port:
        return False
    if host == want_host:
        return True
    return _is_local(want_host) and (_is_local(host) or host in ("0.0.0.0", "::"))


def _gateway_files(directory: Path) -> list[dict[str, object]]:
    """What the gateway files in `directory` say, of gateways still running; the file of a
    gateway that is gone (SIGKILLed: it could not remove it) is removed, token and all."""
    found = []
    for entry in sorted(directory.glob("gateway-*.json")):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            if entry.lstat().st_uid != os.geteuid():
                continue  # not ours: never trusted, and not ours to remove
            info = json.loads(entry.read_text())
            pid = info.get("pid")
            if not isinstance(pid, int) or pid <= 0 or not _ours_running(pid):
                entry.unlink(missing_ok=True)
                continue
            found.append(info)
    return found


def _ours_running(pid: int) -> bool:
    """Whether the process `pid` runs, as this user: a gateway file's process that is another
    user's now (its number taken again after the gateway was killed) is not the gateway, and
    what its file says — the token, the spool — must not go to whoever listens there now."""
    try:
        return running(pid) and os.stat(f"/proc/{pid}").st_uid == os.geteuid()
    except OSError:
        return False


def find_gateway(address: str) -> dict[str, object] | None:
    """What the gateway file of the running gateway at `address` says, if there is one."""
    if address.startswith("unix:"):
        return None  # a Unix socket is guarded by its file mode, not by a token
    try:
        directory = check_private_dir(runtime_dir())
    except OSError:
        return None  # none, or one another user may write: nothing there is trusted
    for info in _gateway_files(directory):
        if same_gateway(str(info.get("address", "")), address):
            return info
    return None


def find_token(address: str) -> str | None:
    """The token of the running gateway at `address`, from its gateway file, if there is one."""
    token = (find_gateway(address) or {}).get("token")
    return token if isinstance(token, str) and token else None


def holds(announced: str) -> Callable[[str], bool]:
    """Whether a server whose address is that IP is the gateway that announced `announced`:
    one of the addresses its host names, or — bound to every address of a family — one of
    that family's, which no other user can then hold at its port. A name matched by
    ``same_gateway`` (localhost for 127.0.0.1) may resolve to another loopback address first
    (::1), where another local user may listen at the same port: connecting is not proof."""
    host, port = _endpoint(announced)
    if host == "0.0.0.0":
        return lambda ip: _ip(ip).version == 4
    if host in ("::", ""):
        return lambda ip: True
    try:
        found = {
            str(info[4][0]) for info in socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
        }
    except OSError:
        found = set()
    mine = {_ip(ip) for ip in found}
    return lambda ip: _ip(ip) in mine


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as a peer's may be given: an IPv4-mapped IPv6 one as its IPv4 address."""
    address = ipaddress.ip_address(text.split("%", 1)[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address
