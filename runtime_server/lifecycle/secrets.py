"""Named secrets the stack keeps for Runs, never a notebook (docs/protocol.md, "Secrets"): a
Run names them (``spec.secrets``), and its handler sees their keys as environment variables;
what a Run, its status, a log, a span or the kernel shows of one is its name and version.

``Secrets`` is what the gateway (set, list, delete) and runtimed (get) ask of a deployment's
store of them (``Topology.open_secrets``): on one machine ``SecretFiles``, a file each in the
private state directory (0600, as the token); on Kubernetes a Secret of the namespace each
(``lifecycle/kubernetes/secrets.py``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from fnkernel.runtime_server import limits
from fnkernel.runtime_server.errors import InvalidField, NotAllowedHere, SecretNotFound
from fnkernel.runtime_server.tokens import write_private
from fnkernel.system.private import private_dir, read_private

SECRETS_DIR = "secrets"  # one machine: STATE_DIR/SECRETS_DIR/NAME
_LOCK_FILE = ".lock"  # not a name (_NAME): never listed
_LAST_VERSION_FILE = ".version"  # the last version any set took, so that none is taken twice
# A name that is a Kubernetes object name's tail too: fnkernel-secret-NAME.
_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
MAX_SECRET_KEYS = 64
MAX_SECRET_BYTES = 256 * 1024  # its keys and values in all
MAX_RUN_SECRETS = 16  # a Run names at most this many (deploy/crd.yaml)


@dataclass(frozen=True)
class Secret:
    """One secret: its `name`, its `version` (another with every set: a Run using it registers
    again), its keys and their values (`data`; empty where only the keys are listed)."""

    name: str
    version: str
    keys: tuple[str, ...]
    data: Mapping[str, str] = field(default_factory=dict, repr=False)  # never in a repr

    def shown(self) -> dict[str, object]:
        """As the gateway and the CLI show it: its name, version and keys, never a value."""
        return {"name": self.name, "version": self.version, "keys": list(self.keys)}


class Secrets(Protocol):
    def set(self, name: str, data: Mapping[str, str]) -> Secret:
        """Keep `data` under `name` (checked: ``check_secret``), replacing what was there;
        the secret as kept, with its new version."""
        ...

    def get(self, name: str) -> Secret:
        """The secret `name` with its values; SecretNotFound if there is none."""
        ...

    def list(self) -> list[Secret]:
        """Every secret, by name, with its keys and version and no values."""
        ...

    def delete(self, name: str) -> None:
        """Remove `name`; SecretNotFound if there is none."""
        ...


class NoSecrets:
    """The store of a component built without one (a test's gateway): it has none, and keeps
    none."""

    def set(self, name: str, data: Mapping[str, str]) -> Secret:
        raise NotAllowedHere("this gateway keeps no secrets")

    def get(self, name: str) -> Secret:
        raise SecretNotFound(f"secret {name!r} does not exist")

    def list(self) -> list[Secret]:
        return []

    def delete(self, name: str) -> None:
        raise SecretNotFound(f"secret {name!r} does not exist")


def rotated_secret(
    secrets: Secrets, versions: Mapping[str, str], seen: dict[str, str | None] | None = None
) -> str:
    """Why a registration made with the secrets' `versions` is out of date: the first secret
    that has another version now, or is gone; "" if none is. `seen`: the versions already read
    in this pass (None: gone), filled as it reads, so each secret is read once however many
    Runs use it (on Kubernetes, a GET each)."""
    seen = {} if seen is None else seen
    for name, version in sorted(versions.items()):
        if name not in seen:
            try:
                seen[name] = secrets.get(name).version
            except SecretNotFound:
                seen[name] = None
        now = seen[name]
        if now is None:
            return f"secret {name!r} was deleted"
        if now != version:
            return f"secret {name!r} changed (version {version} → {now})"
    return ""


def secret_versions(secrets: Secrets, names: Iterable[str]) -> dict[str, str]:
    """The version of each secret `names` names, "" for one that does not exist: what a Run
    failed for a missing secret records, to be registered again once all are set."""
    versions = {}
    for name in names:
        try:
            versions[name] = secrets.get(name).version
        except SecretNotFound:
            versions[name] = ""
    return versions


def secrets_set_again(secrets: Secrets, versions: Mapping[str, str]) -> str:
    """Why a Run Failed for a secret that did not exist (its version "" in `versions`, as
    ``secret_versions`` gives it) can be registered again: every one of them exists now; ""
    if it cannot, or did not fail so."""
    if "" not in versions.values() or "" in secret_versions(secrets, versions).values():
        return ""
    return f"its secrets ({', '.join(sorted(versions))}) exist again"


def check_secret_name(name: object, field: str = "name") -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidField(
            field, "must be 1-63 lower-case letters, digits and '-', starting and ending with "
            "a letter or digit",
        )  # fmt: skip
    return name


def check_secret(name: object, data: object) -> tuple[str, dict[str, str]]:
    """A secret's name and data as a set takes them: keys are environment variable names, values
    text; InvalidField naming what is not."""
    checked_name = check_secret_name(name)
    if not isinstance(data, Mapping) or not data:
        raise InvalidField("data", "must be an object of at least one KEY: value")
    if len(data) > MAX_SECRET_KEYS:
        raise InvalidField("data", f"{len(data)} keys; at most {MAX_SECRET_KEYS}")
    checked: dict[str, str] = {}
    for key, value in data.items():
        if not isinstance(key, str) or not limits.ENV_KEY.fullmatch(key):
            raise InvalidField("data", f"key {str(key)[:64]!r} is not an environment variable name")
        if not isinstance(value, str) or "\0" in value:
            raise InvalidField(f"data.{key}", "must be text without NUL")  # the value unsaid
        checked[key] = value
    size = sum(len(k.encode()) + len(v.encode()) for k, v in checked.items())
    if size > MAX_SECRET_BYTES:
        raise InvalidField("data", f"{size} bytes in all; at most {MAX_SECRET_BYTES}")
    return checked_name, checked


def check_secret_names(names: object, field: str = "secrets") -> tuple[str, ...]:
    """A Run's ``secrets``: distinct secret names."""
    if names is None:
        return ()
    if not isinstance(names, (list, tuple)):
        raise InvalidField(field, "must be an array of secret names")
    if len(names) > MAX_RUN_SECRETS:
        raise InvalidField(field, f"{len(names)} secrets; at most {MAX_RUN_SECRETS}")
    checked = tuple(check_secret_name(name, f"{field}[{i}]") for i, name in enumerate(names))
    if len(set(checked)) != len(checked):
        raise InvalidField(field, "names a secret twice")
    return checked


class SecretFiles:
    """The secrets of one machine, in `directory` (STATE_DIR/secrets): NAME, each a JSON file
    {version, data},
    0600 in a 0700 directory (README, "Security"), written whole or not at all. A version is
    the store's, as a Kubernetes resourceVersion is: each set takes the next, so a secret
    deleted and set again never has a version it had before (a Run using it would not see it
    change)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = threading.Lock()  # a set's version is the last one taken, plus one

    def _path(self, name: str) -> Path:
        return private_dir(self.directory) / check_secret_name(name)

    def set(self, name: str, data: Mapping[str, str]) -> Secret:
        name, checked = check_secret(name, data)
        path = self._path(name)
        # One set at a time, across threads and processes (the gateway's, and `fnkernel
        # secrets` on this machine's store): two sets must not both take the same version.
        lock_path = private_dir(self.directory) / _LOCK_FILE
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
        with self._lock, open(os.open(lock_path, flags, 0o600), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            version = self._last_version() + 1
            write_private(private_dir(self.directory) / _LAST_VERSION_FILE, str(version))
            write_private(path, json.dumps({"version": version, "data": checked}))
        return Secret(name, str(version), tuple(sorted(checked)), checked)

    def _last_version(self) -> int:
        """The last version a set took: recorded, or (a store kept before versions were the
        store's) the largest any secret has."""
        try:
            return int((private_dir(self.directory) / _LAST_VERSION_FILE).read_text())
        except (FileNotFoundError, ValueError):
            return max((int(secret.version) for secret in self.list()), default=0)

    def get(self, name: str) -> Secret:
        try:
            kept = json.loads(read_private(self._path(name)))
        except FileNotFoundError:
            raise SecretNotFound(f"secret {name!r} does not exist") from None
        data = dict(kept["data"])
        return Secret(name, str(kept["version"]), tuple(sorted(data)), data)

    def list(self) -> list[Secret]:
        found = []
        with contextlib.suppress(FileNotFoundError):
            for entry in sorted(os.scandir(private_dir(self.directory)), key=lambda e: e.name):
                if _NAME.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                    with contextlib.suppress(OSError, ValueError, KeyError):
                        secret = self.get(entry.name)
                        found.append(Secret(secret.name, secret.version, secret.keys))
        return found

    def delete(self, name: str) -> None:
        try:
            self._path(name).unlink()
        except FileNotFoundError:
            raise SecretNotFound(f"secret {name!r} does not exist") from None
