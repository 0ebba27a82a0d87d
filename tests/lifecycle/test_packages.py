"""The node's package cache (docs/protocol.md, "Requirements"), with uv against a wheelhouse the
test builds (tests/wheelhouse.py): no index is ever reached."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from fnkernel.runtime_server.errors import RequirementsFailed
from fnkernel.runtime_server.lifecycle.runtimed.packages import Environment, PackageCache
from tests.wheelhouse import build_wheelhouse, offline_index


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheelhouse(tmp_path_factory.mktemp("wheelhouse"))


def cache_at(root: Path, wheelhouse: Path, **kwargs: object) -> PackageCache:
    return PackageCache(root, environ=offline_index(wheelhouse), **kwargs)  # type: ignore[arg-type]


def imported(env: Environment, module: str) -> tuple[str, str]:
    """What a Python with `env` ahead of its own site-packages imports as `module`: its
    VERSION and file."""
    code = f"import sys; sys.path.insert(0, {str(env.path)!r}); import {module} as m; print(m.VERSION); print(m.__file__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    version, path = out.stdout.splitlines()
    return version, path


def test_a_set_is_resolved_with_its_dependencies_and_installed_into_one_directory(
    tmp_path: Path, wheelhouse: Path
) -> None:
    lines: list[str] = []
    env = cache_at(tmp_path / "cache", wheelhouse).environment(["fnk-beta"], lines.append)
    assert env.digest.startswith("sha256:") and len(env.digest) == 71
    assert imported(env, "fnk_beta") == ("1.0", str(env.path / "fnk_beta" / "__init__.py"))
    # fnk-beta's dependency, at the newest version the wheelhouse has
    assert imported(env, "fnk_alpha")[0] == "2.0"
    assert any("fnk-beta" in line for line in lines)  # uv's own lines, as progress


def test_a_set_already_installed_costs_no_resolve_and_no_install(
    tmp_path: Path, wheelhouse: Path
) -> None:
    cache = cache_at(tmp_path / "cache", wheelhouse)
    first = cache.environment(["fnk-alpha==1.0"])
    again: list[str] = []
    assert cache.environment(["fnk-alpha==1.0"], again.append) == first
    assert again == []  # uv was not run
    # another cache object on the same directory (a restarted runtimed): the same
    assert cache_at(tmp_path / "cache", wheelhouse).environment(["fnk-alpha==1.0"]) == first


def test_each_set_has_its_own_environment_and_digest(tmp_path: Path, wheelhouse: Path) -> None:
    cache = cache_at(tmp_path / "cache", wheelhouse)
    old, new = cache.environment(["fnk-alpha==1.0"]), cache.environment(["fnk-alpha==2.0"])
    assert old.digest != new.digest and old.path != new.path
    assert imported(old, "fnk_alpha")[0] == "1.0"
    assert imported(new, "fnk_alpha")[0] == "2.0"


def test_a_set_several_ask_for_at_once_is_built_once(tmp_path: Path, wheelhouse: Path) -> None:
    cache = cache_at(tmp_path / "cache", wheelhouse)
    installs: list[str] = []
    lock = threading.Lock()

    def ask() -> None:
        def progress(line: str) -> None:
            if line.startswith("Installed"):
                with lock:
                    installs.append(line)

        results.append(cache.environment(["fnk-beta"], progress))

    results: list[Environment] = []
    threads = [threading.Thread(target=ask) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(results) == 4 and len(set(results)) == 1
    assert len(installs) == 1, installs


def test_a_requirement_that_cannot_be_resolved_fails_naming_it_in_uvs_words(
    tmp_path: Path, wheelhouse: Path
) -> None:
    cache = cache_at(tmp_path / "cache", wheelhouse)
    with pytest.raises(RequirementsFailed) as failed:
        cache.environment(["fnk-alpha>=9"])
    message = str(failed.value)
    assert message.startswith("cannot resolve the requirements: ")
    assert "fnk-alpha" in message
    assert len(message.encode()) <= 1024
    # nothing is left that a later call could take for a resolution
    assert list((tmp_path / "cache" / "resolved").iterdir()) == []


def test_pips_index_settings_reach_uv(tmp_path: Path, wheelhouse: Path) -> None:
    # A team's PIP_FIND_LINKS / PIP_NO_INDEX are uv's UV_FIND_LINKS / UV_NO_INDEX.
    cache = PackageCache(
        tmp_path / "cache", environ={"PIP_FIND_LINKS": str(wheelhouse), "PIP_NO_INDEX": "1"}
    )
    assert imported(cache.environment(["fnk-alpha==1.0"]), "fnk_alpha")[0] == "1.0"


def test_past_its_bound_the_cache_evicts_the_least_recently_used_set_not_one_in_use(
    tmp_path: Path, wheelhouse: Path
) -> None:
    cache = cache_at(tmp_path / "cache", wheelhouse, max_bytes=1)  # room for the newest only
    held = cache.environment(["fnk-alpha==1.0"])
    cache.keep([held.digest])  # a registration uses it
    other = cache.environment(["fnk-alpha==2.0"])
    assert held.path.is_dir() and other.path.is_dir()  # held: not evicted
    cache.keep([other.digest])  # the first registration is gone
    newest = cache.environment(["fnk-beta"])
    assert not held.path.exists()  # evicted: least recently used, and not held
    assert other.path.is_dir() and newest.path.is_dir()
    # an evicted set is installed again when asked for
    assert cache.environment(["fnk-alpha==1.0"]).path.is_dir()


def test_the_cache_is_private(tmp_path: Path, wheelhouse: Path) -> None:
    cache_at(tmp_path / "cache", wheelhouse).environment(["fnk-alpha==1.0"])
    assert (tmp_path / "cache").stat().st_mode & 0o777 == 0o700
