"""A Run's requirements on its node (docs/protocol.md, "Requirements"): resolved by uv into a
lock — exact versions and hashes — and installed once per lock into a directory of the node's
package cache, which the worker puts on ``sys.path`` ahead of the pod's own site-packages. An
environment is shared by every Run and replica whose requirements resolve to the same lock,
built once when several ask for it at the same moment (a file lock, so two runtimeds sharing a
cache wait for each other too), and evicted least recently used past the cache's size bound —
never while a registration of any runtimed uses it (``keep``).

The cache's layout, under its root::

    resolved/KEY.lock     the lock of one requirement set (KEY: the set, the interpreter, the index)
    envs/DIGEST/          the lock's packages (DIGEST: the lock's SHA-256)
    envs/DIGEST.ready     written last: the size in bytes; its mtime is the last use
    locks/NAME            flock files: one resolve or install of NAME at a time
    uv/                   uv's own cache (wheels downloaded and built)
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fnkernel.runtime_server import limits
from fnkernel.runtime_server.errors import RequirementsFailed

LOG = logging.getLogger("fnkernel.runtimed")

# The index settings, and pip's names of them (a team's pip habits): uv reads no PIP_*, so each
# is passed to uv under its own name unless that is set already. UV_NO_INDEX is ours (uv has
# only the flag): it, or PIP_NO_INDEX, set to a true value is uv's --no-index.
INDEX_SETTINGS = {
    "UV_INDEX_URL": "PIP_INDEX_URL",
    "UV_EXTRA_INDEX_URL": "PIP_EXTRA_INDEX_URL",
    "UV_FIND_LINKS": "PIP_FIND_LINKS",
    "UV_NO_INDEX": "PIP_NO_INDEX",
}
_TRUE = ("1", "true", "yes", "on")
DEFAULT_MAX_BYTES = 10 << 30
INSTALL_TIMEOUT_SECONDS = 600.0
_ERROR_LINES = 12  # of uv's own words, the last ones: where it says what failed


@dataclass(frozen=True)
class Environment:
    """An installed requirement set: `path` goes on the worker's sys.path; `digest` is the
    lock's ``sha256:`` digest, which the registration digest covers."""

    path: Path
    digest: str


def throttled(write: Callable[[str], object], every: float = 0.5) -> Callable[[str], None]:
    """An installer's progress as a Run's status message: `write` gets a line at most every
    `every` seconds (the first at once), prefixed so a reader knows what it is."""
    last = [-math.inf]

    def report(line: str) -> None:
        now = time.monotonic()
        if now - last[0] >= every:
            last[0] = now
            write(limits.bounded(f"installing requirements: {line}"))

    return report


class PackageCache:
    """The node's cache of environments, at `root` (made 0700), at most `max_bytes` of them."""

    def __init__(
        self,
        root: Path,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        python: str = sys.executable,
        environ: Mapping[str, str] | None = None,
        install_timeout: float = INSTALL_TIMEOUT_SECONDS,
    ) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.python = python
        self.install_timeout = install_timeout
        self._environ = dict(os.environ if environ is None else environ)
        for name, pip_name in INDEX_SETTINGS.items():
            if name not in self._environ and pip_name in self._environ:
                self._environ[name] = self._environ[pip_name]
        self._held: dict[str, int] = {}  # digest -> the descriptor of its shared lock
        self._lock = threading.Lock()
        self._made = False

    def _make(self) -> None:
        """The cache's directories, made on its first use: a pod whose Runs have no
        requirements writes nothing here."""
        if not self._made:
            # A root made here is 0700; one the deployment gives (a pod's emptyDir, which is
            # not ours to chmod) keeps its mode, and everything in it is in 0700 directories.
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            for sub in ("resolved", "envs", "locks", "uv"):
                (self.root / sub).mkdir(exist_ok=True, mode=0o700)
            self._made = True

    def environment(
        self, requirements: Sequence[str], progress: Callable[[str], None] = lambda line: None
    ) -> Environment:
        """The environment of `requirements`, resolved and installed if it is not in the cache
        yet (`progress` gets uv's lines as they come). RequirementsFailed with uv's words if
        they cannot be resolved or installed."""
        self._make()
        lock_text = self._resolved(requirements, progress)
        digest = "sha256:" + hashlib.sha256(lock_text.encode()).hexdigest()
        name = digest.removeprefix("sha256:")
        env, ready = self.root / "envs" / name, self.root / "envs" / f"{name}.ready"
        if not ready.exists():
            with self._exclusive(f"env-{name}"):
                if not ready.exists():
                    self._install(lock_text, env, ready, progress)
                    self._evict(keep=name)
        with contextlib.suppress(OSError):
            os.utime(ready)  # its last use, for the eviction's order
        return Environment(env, digest)

    def registered_with(self, requirements: Sequence[str]) -> Environment | None:
        """The environment a registration of `requirements` was made with: None if there are
        none, or if they do not resolve (so no registration was made)."""
        if not requirements:
            return None
        try:
            return self.environment(requirements)
        except (RequirementsFailed, OSError):
            return None

    def keep(self, digests: Iterable[str]) -> None:
        """The environments this runtimed's registrations use now: each is held (a shared lock
        on its marker) so no eviction, by this runtimed or another, removes it; any other this
        runtimed held is let go."""
        wanted = {digest.removeprefix("sha256:") for digest in digests if digest}
        with self._lock:
            for name in set(self._held) - wanted:
                os.close(self._held.pop(name))
            for name in wanted - set(self._held):
                try:
                    fd = os.open(self.root / "envs" / f"{name}.ready", os.O_RDONLY)
                except OSError:
                    continue  # evicted before it was held: the next registration installs it
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except OSError:  # being evicted this moment: as if it were gone
                    os.close(fd)
                    continue
                self._held[name] = fd

    # Resolving

    def _resolved(self, requirements: Sequence[str], progress: Callable[[str], None]) -> str:
        """The lock of `requirements`: uv's resolution, kept per set, interpreter and index (a
        set resolves once on a node; a changed requirement is another set)."""
        key = json.dumps(
            {
                "requirements": sorted(requirements),
                "python": self.python,
                "index": {name: self._environ.get(name, "") for name in INDEX_SETTINGS},
            },
            sort_keys=True,
        )
        name = hashlib.sha256(key.encode()).hexdigest()
        path = self.root / "resolved" / f"{name}.lock"
        with contextlib.suppress(FileNotFoundError):
            return path.read_text()
        with self._exclusive(f"resolve-{name}"):
            with contextlib.suppress(FileNotFoundError):
                return path.read_text()
            with tempfile.TemporaryDirectory(dir=self.root / "locks") as scratch:
                wanted, lock = Path(scratch) / "requirements.in", Path(scratch) / "requirements.txt"
                wanted.write_text("".join(f"{line}\n" for line in requirements))
                progress(f"resolving {', '.join(requirements)}")
                self._uv(
                    "resolve",
                    ["pip", "compile", str(wanted), "-o", str(lock), "--generate-hashes",
                     "--no-header", "--no-annotate", "--python", self.python],
                    progress,
                )  # fmt: skip
                text = lock.read_text()
            staged = path.with_suffix(".tmp")
            staged.write_text(text)
            staged.replace(path)
            return text

    # Installing

    def _install(
        self, lock_text: str, env: Path, ready: Path, progress: Callable[[str], None]
    ) -> None:
        """Install the lock into `env`: staged beside it and renamed into place, then `ready`
        written, so a cache entry is whole or absent (a killed install leaves only a stage,
        removed by the next install of the same lock)."""
        stage = env.with_name(f"{env.name}.stage")
        shutil.rmtree(stage, ignore_errors=True)
        shutil.rmtree(env, ignore_errors=True)  # a rename that was not followed by `ready`
        stage.mkdir(mode=0o700)
        lock = stage.with_name(f"{env.name}.stage.txt")
        lock.write_text(lock_text)
        try:
            self._uv(
                "install",
                ["pip", "install", "-r", str(lock), "--target", str(stage), "--require-hashes",
                 "--no-deps", "--python", self.python],
                progress,
            )  # fmt: skip
            stage.rename(env)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
        finally:
            lock.unlink(missing_ok=True)
        size = sum(path.stat().st_size for path in env.rglob("*") if path.is_file())
        staged = ready.with_suffix(".tmp")
        staged.write_text(str(size))
        staged.replace(ready)

    def _uv(self, doing: str, args: list[str], progress: Callable[[str], None]) -> None:
        """Run uv with `args`, each line it writes to `progress`; RequirementsFailed with its
        last lines if it fails or outlives the install timeout."""
        from uv import find_uv_bin

        if self._environ.get("UV_NO_INDEX", "").lower() in _TRUE:
            args = [*args, "--no-index"]
        env = {
            **self._environ,
            "UV_CACHE_DIR": str(self.root / "uv"),
            "NO_COLOR": "1",
            "UV_NO_PROGRESS": "1",
            "UV_PYTHON_DOWNLOADS": "never",  # the pod's own Python, never another
        }
        child = subprocess.Popen(
            [find_uv_bin(), *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            env=env,
            start_new_session=True,
        )
        lines: list[str] = []
        timed_out = threading.Event()

        def kill() -> None:
            timed_out.set()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)  # uv and the builds it started

        timer = threading.Timer(self.install_timeout, kill)
        timer.start()
        try:
            assert child.stderr is not None
            for raw in child.stderr:
                line = raw.rstrip()
                if line:
                    lines = [*lines[-(_ERROR_LINES - 1) :], line]
                    progress(line)
            code = child.wait()
        except BaseException:
            kill()
            child.wait()
            raise
        finally:
            timer.cancel()
        if code == 0:
            return
        words = "\n".join(lines) or f"uv exited with status {code}"
        if timed_out.is_set():
            words = f"did not finish in {self.install_timeout:g} s"
        raise RequirementsFailed(limits.bounded(f"cannot {doing} the requirements: {words}"))

    # Evicting

    def _evict(self, keep: str) -> None:
        """Remove environments, least recently used first, until the cache is within its bound;
        never `keep` (the one just made) nor one a registration holds (``keep``, any runtimed)."""
        entries = []
        for ready in (self.root / "envs").glob("*.ready"):
            try:
                entries.append((ready.stat().st_mtime, ready, int(ready.read_text() or 0)))
            except (OSError, ValueError):
                continue
        total = sum(size for _, _, size in entries)
        for _, ready, size in sorted(entries):
            if total <= self.max_bytes:
                return
            name = ready.name.removesuffix(".ready")
            if name == keep:
                continue
            with self._unused(ready) as unused:
                if not unused:
                    continue
                ready.unlink()  # first: an entry without its marker is absent
                shutil.rmtree(self.root / "envs" / name, ignore_errors=True)
                total -= size
                LOG.info("package cache: evicted %s (%d bytes)", name[:12], size)

    @contextlib.contextmanager
    def _unused(self, ready: Path) -> Iterator[bool]:
        """Whether no registration holds the environment of `ready`: an exclusive lock on it,
        taken without waiting, kept while the block runs."""
        try:
            fd = os.open(ready, os.O_RDONLY)
        except OSError:
            yield False
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            yield False
            return
        try:
            yield True
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _exclusive(self, name: str) -> Iterator[None]:
        """One holder of `name` at a time, across threads and processes (flock on a file of
        `locks/`, each holder with a descriptor of its own)."""
        fd = os.open(self.root / "locks" / name, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            started = time.monotonic()
            fcntl.flock(fd, fcntl.LOCK_EX)
            waited = time.monotonic() - started
            if waited > 1:
                LOG.info("package cache: waited %.1f s for %s", waited, name)
            yield
        finally:
            os.close(fd)
