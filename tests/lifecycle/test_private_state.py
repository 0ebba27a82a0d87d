"""README, "Security": what fnkernel keeps on disk — the state dir with its workspace, sockets,
logs, store and token, and the runtime dir of gateway files — is this user's alone. A directory
another local user made first, or may write, is refused before anything is written into it, and
every file that may hold a secret is created 0600, never through a file someone placed first."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from fnkernel.runtime_server import tokens
from fnkernel.runtime_server.daemon import spawn
from fnkernel.runtime_server.lifecycle.sqlite import SqliteRunStore
from fnkernel.runtime_server.lifecycle.stack import Stack
from fnkernel.system.private import NotPrivate, private_dir
from tests.support import wait_until

NOBODY = 65534
# Under CI (which runs as root) a test that cannot run fails instead: never a silent skip.
as_root = pytest.mark.skipif(
    os.geteuid() != 0 and os.environ.get("CI") != "true",
    reason="making a file another user's needs root",
)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A directory whose STATE_DIR/sock is short enough to bind: a stack keeps its sockets there
    only then, else in a temp dir of its own (Stack._socket_dir), and pytest's tmp_path can be
    longer (under pytest-xdist, by a directory per test process)."""
    made = Path(tempfile.mkdtemp(prefix="fnk-"))
    yield made
    shutil.rmtree(made, ignore_errors=True)


def shared_tmp(tmp_path: Path) -> Path:
    """A sticky, world-writable directory, like /tmp: where another user can make names first."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    return shared


def up(state_dir: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`fnkernel up` on that state dir; it is stopped at once if it did start."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "fnkernel.runtime_server.cli", "up", "--pods", "python=1",
         "--state-dir", str(state_dir), "--gateway-listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})},
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "ready;" in line:
                proc.send_signal(signal.SIGTERM)
                break
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@as_root
def test_a_state_dir_another_user_made_first_is_refused_and_gets_nothing(tmp_path: Path) -> None:
    # The attack: another local user makes the state dir first, world-writable, in a shared
    # temp dir, and waits for the token, the store's env secrets and a Run's handler source.
    state = shared_tmp(tmp_path) / "state"
    state.mkdir()
    state.chmod(0o777)
    os.chown(state, NOBODY, NOBODY)
    result = up(state)
    assert result.returncode != 0
    assert str(state) in result.stderr and f"owned by uid {NOBODY}" in result.stderr
    assert list(state.iterdir()) == [], "nothing is written into a directory that is not ours"


@pytest.mark.parametrize("where", ["", "workspace", "logs", "sock"])
def test_a_state_dir_or_subdirectory_others_may_write_is_refused_naming_it(
    short_tmp: Path, where: str
) -> None:
    state = short_tmp / "state"
    loose = state / where
    loose.mkdir(parents=True)
    loose.chmod(0o777 if where else 0o757)
    stack = Stack(state, {"python": 1}, gateway_listen="127.0.0.1:0")
    with pytest.raises(NotPrivate) as refused:
        stack.start()
    message = str(refused.value)
    assert message.startswith(f"{loose.resolve()}:") and "chmod 700" in message
    assert ("its group and others" if where else "others") in message
    assert not (state / "runs.db").exists() and not (state / "token").exists()
    assert stack.components == []  # nothing was started


def test_a_missing_state_dir_is_made_0700_with_its_missing_parents(tmp_path: Path) -> None:
    # README, "Security": a missing state dir is made 0700 — by whichever command makes it
    # first (`fnkernel secrets set --state-dir NEW` made it 755, its parents' mode, as
    # mkdir(parents=True) makes parents), and the parents it makes with it too.
    made = private_dir(tmp_path / "new" / "state" / "secrets")
    for directory in (made, made.parent, made.parent.parent):
        assert directory.stat().st_mode & 0o777 == 0o700, directory


def test_a_directory_that_is_a_file_is_refused() -> None:
    with pytest.raises(NotPrivate, match="not a directory"):
        private_dir(Path(__file__))


@as_root
def test_a_state_dir_owned_by_another_user_is_refused_even_with_a_private_mode(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    os.chown(state, NOBODY, NOBODY)
    with pytest.raises(NotPrivate, match=f"owned by uid {NOBODY}, not by this user"):
        private_dir(state)


def test_every_file_that_may_hold_a_secret_is_0600(stack_factory, short_tmp: Path) -> None:  # type: ignore[no-untyped-def]
    stack = stack_factory({"python": 1}, state_dir=short_tmp / "state")
    state = stack.state_dir
    store = state / "runs.db"
    wait_until(lambda: Path(f"{store}-shm").exists() and Path(f"{store}-wal").exists())
    secret = [store, Path(f"{store}-wal"), Path(f"{store}-shm"), state / "token"]
    secret += sorted((state / "logs").iterdir())
    assert len(secret) == 4 + 3  # the gateway's log and the pod's two
    assert {path.name: mode(path) for path in secret} == dict.fromkeys(
        (path.name for path in secret), 0o600
    )
    for directory in (state, state / "workspace", state / "logs", state / "sock"):
        assert mode(directory) == 0o700, directory


def test_an_older_stores_loose_files_are_made_0600(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    old = sqlite3.connect(path)  # as an older fnkernel made it: the umask's 0644
    old.execute("PRAGMA journal_mode=WAL")
    old.execute("CREATE TABLE t (x)")
    old.commit()
    files = [path, Path(f"{path}-wal"), Path(f"{path}-shm")]
    for file in files:
        file.chmod(0o644)
    store = SqliteRunStore(path)
    try:
        assert [mode(file) for file in files] == [0o600] * 3
    finally:
        store.close()
        old.close()


def test_the_token_never_goes_into_a_file_placed_first_under_its_temporary_name(
    tmp_path: Path,
) -> None:
    # The temporary file's name is predictable (.token.PID.tmp). A hard link placed there to a
    # file of the attacker's would receive the token if the name were opened as it is.
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    theirs = tmp_path / "theirs"
    theirs.write_text("")
    os.link(theirs, state / f".token.{os.getpid()}.tmp")
    written = tokens.write_private(state / "token", "s3cret\n")
    assert written.read_text() == "s3cret\n" and mode(written) == 0o600
    assert theirs.read_text() == ""
    assert not (state / f".token.{os.getpid()}.tmp").exists()


def test_a_runtime_dir_others_may_write_gets_no_gateway_file(tmp_path: Path) -> None:
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    runtime.chmod(0o777)
    env = {**os.environ, tokens.RUNTIME_DIR_ENV: str(runtime)}
    result = subprocess.run(
        [sys.executable, "-m", "fnkernel.runtime_server.cli", "gateway", "--listen", "127.0.0.1:0",
         "--state-dir", str(tmp_path / "state")],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert result.returncode == 1
    assert f"cannot write its gateway file: {runtime}:" in result.stderr
    assert list(runtime.iterdir()) == []


def test_clients_trust_no_gateway_file_in_a_runtime_dir_others_may_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    monkeypatch.setenv(tokens.RUNTIME_DIR_ENV, str(runtime))
    planted = {"address": "http://127.0.0.1:8080", "token": "planted", "pid": os.getpid()}
    (runtime / f"gateway-{os.getpid()}.json").write_text(json.dumps(planted))
    runtime.chmod(0o700)
    assert tokens.find_token("http://127.0.0.1:8080") == "planted"  # ours: trusted
    runtime.chmod(0o777)
    assert tokens.find_token("http://127.0.0.1:8080") is None


def test_the_gateway_file_of_a_killed_gateway_is_removed_by_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(tokens.RUNTIME_DIR_ENV, str(tmp_path / "runtime"))
    killed = spawn(["gateway", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "a")])
    left = tmp_path / "runtime" / f"gateway-{killed.pid}.json"
    assert left.exists()
    killed.proc.kill()
    killed.proc.wait()
    assert left.exists(), "a SIGKILLed gateway cannot remove its own file"
    following = spawn(["gateway", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "b")])
    try:
        assert not left.exists(), "the next gateway removes it, token and all"
        assert (tmp_path / "runtime" / f"gateway-{following.pid}.json").exists()
    finally:
        following.stop()


def test_a_client_looking_for_a_token_removes_the_files_of_gateways_that_are_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(tokens.RUNTIME_DIR_ENV, str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    pid = int(gone.stdout)
    stale = tmp_path / f"gateway-{pid}.json"
    stale.write_text(json.dumps({"address": "http://127.0.0.1:1", "token": "t", "pid": pid}))
    tmp_path.chmod(0o700)
    assert tokens.find_token("http://127.0.0.1:1") is None
    assert not stale.exists()


def test_a_gateway_file_whose_process_is_another_users_now_is_not_trusted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # README, "Security": a killed gateway leaves its file; its process number may be another
    # user's process's later, who may then listen at its address. Such a file is no gateway's:
    # removed, its token given to nobody.
    monkeypatch.setenv(tokens.RUNTIME_DIR_ENV, str(tmp_path))
    tmp_path.chmod(0o700)
    other = None
    if os.geteuid() == 0:  # a process of another user's: nobody's
        other = subprocess.Popen(["sleep", "60"], user=65534)
        pid = other.pid
    else:
        pid = 1  # init's: root's
    try:
        stale = tmp_path / f"gateway-{pid}.json"
        stale.write_text(json.dumps({"address": "http://127.0.0.1:1", "token": "t", "pid": pid}))
        assert tokens.find_token("http://127.0.0.1:1") is None
        assert not stale.exists()
    finally:
        if other is not None:
            other.kill()
            other.wait()
