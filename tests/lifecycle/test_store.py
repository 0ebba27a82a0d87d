"""docs/protocol.md, "State on disk": a Run store that SQLite finds damaged is refused when a
component starts, with the file's path and SQLite's own words, in the terminal — never a stack
that says it is ready and then answers 500 to every read that reaches a bad page."""

from __future__ import annotations

import json
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fnkernel.runtime_server.daemon import spawn
from fnkernel.runtime_server.errors import RunNotFound, StoreDamaged
from fnkernel.runtime_server.lifecycle.runs import Run, RunSpec, RunStatus, files_digest
from fnkernel.runtime_server.lifecycle.sqlite import SqliteRunStore
from fnkernel.runtime_server.wire import PENDING
from tests.support import http_call


def filled_store(path: Path, runs: int = 300) -> None:
    """A store with enough Runs to span many pages, closed (its WAL folded into the file)."""
    store = SqliteRunStore(path)
    for n in range(runs):
        files = {"h.py": f"def handle(event):\n    return {n}\n"}
        store.insert(
            Run(uid=f"uid-{n}", name=f"run-{n}", created_at=time.time(),
                spec=RunSpec("python", "h.handle", files_digest(files), env={"KEY": "v" * 200},
                             idle_timeout_seconds=900, source="1 file(s)"),
                status=RunStatus(phase=PENDING, attempt=1)),
            files,
        )  # fmt: skip
    store.close()
    assert not Path(f"{path}-wal").exists()


def scribble(path: Path) -> None:
    """4 KiB of random bytes over the middle of the file, as a bad disk or a stray write would."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4096] = random.Random(26).randbytes(4096)
    path.write_bytes(bytes(data))


def up(state_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fnkernel.runtime_server.cli", "up", "--pods", "python=1",
         "--state-dir", str(state_dir), "--gateway-listen", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.parametrize("damage", ["scribbled", "truncated"])
def test_up_refuses_a_damaged_store_naming_it_with_sqlites_words(
    tmp_path: Path, damage: str
) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    store = state / "runs.db"
    filled_store(store)
    if damage == "scribbled":
        scribble(store)
    else:
        store.write_bytes(store.read_bytes()[:1000])
    result = up(state)
    assert result.returncode == 1, result.stderr
    assert f"{store}: the Run store is damaged: " in result.stderr
    assert "(SQLite)" in result.stderr and "Traceback" not in result.stderr
    assert "ready;" not in result.stdout


def test_a_damaged_store_is_found_by_quick_check_not_by_the_first_read(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    filled_store(path)
    scribble(path)
    with pytest.raises(StoreDamaged, match=r"the Run store is damaged: .+ \(SQLite\)"):
        SqliteRunStore(path)


def test_a_component_that_does_not_start_says_why_not_only_in_its_log(tmp_path: Path) -> None:
    # What the gateway printed before it exited reaches whoever started it: `fnkernel up`'s
    # terminal, the kernel's error.
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "runs.db").write_bytes(b"not a database, but long enough to be read as one" * 100)
    with (tmp_path / "gateway.log").open("a") as log:
        log.write("a line of an earlier run\n")
        log.flush()
        with pytest.raises(RuntimeError) as failed:
            spawn(["gateway", "--listen", "127.0.0.1:0", "--state-dir", str(state)], stderr=log)
    message = str(failed.value)
    assert "gateway --listen 127.0.0.1:0" in message
    assert "did not start: exit status 1; fnkernel: " in message
    assert "the Run store is damaged: file is not a database (SQLite)" in message
    assert "earlier run" not in message


def test_a_sound_store_opens_and_keeps_every_run(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    filled_store(path, runs=50)
    store = SqliteRunStore(path)
    try:
        assert len(store.runs()) == 50
    finally:
        store.close()


def _can_mount_a_small_disk() -> bool:
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    probe = subprocess.run(
        [unshare, "--user", "--map-root-user", "--mount", "sh", "-c",
         "mount -t tmpfs -o size=64k tmpfs /mnt"],
        capture_output=True, timeout=30,
    )  # fmt: skip
    return probe.returncode == 0


# Under CI a machine that cannot mount one fails these tests instead: never a silent skip.
small_disk = pytest.mark.skipif(
    os.environ.get("CI") != "true" and not _can_mount_a_small_disk(),
    reason="needs unshare and a tmpfs in a mount namespace",
)


def on_a_small_disk(state: Path, size: str, script: str) -> subprocess.Popen[str]:
    """`script` (sh, the state dir as $0) in a mount namespace of its own where the state dir is a
    tmpfs of `size`: a full disk of the test's own, that nothing else on the machine sees."""
    state.mkdir(mode=0o700)
    mount = f'mount -t tmpfs -o size={size},mode=0700 tmpfs "$0" && {script}'
    return subprocess.Popen(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", mount, str(state)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


@small_disk
def test_a_create_that_meets_a_full_disk_is_503_naming_enospc_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    up = (
        f'exec {sys.executable} -m fnkernel.runtime_server.cli up --pods python=1 --state-dir "$0" '
    )
    up += "--gateway-listen 127.0.0.1:0 --no-token"
    proc = on_a_small_disk(tmp_path / "state", "4m", up)
    try:
        assert proc.stdout is not None
        ready = next(line for line in proc.stdout if "ready;" in line)
        address = ready.split("gateway ", 1)[1].split(";", 1)[0]
        files = {f"data{n}.txt": "x" * (1 << 20) for n in range(5)}  # 5 MiB: under 6, over 4
        files["handler.py"] = "def handle(event):\n    return event\n"
        spec = {"name": "big", "runtime": "python", "handler": "handler.handle", "files": files}
        status, headers, reply = http_call(address, "POST", "/v1/runs", json.dumps(spec).encode())
        assert status == 503 and headers["Retry-After"] == "1", reply
        message = json.loads(reply)["message"]
        assert "no space left on the state dir's disk writing " in message and "ENOSPC" in message
        assert json.loads(http_call(address, "GET", "/v1/runs")[2]) == {"runs": []}
        del files["data0.txt"], files["data1.txt"], files["data2.txt"], files["data3.txt"]
        spec["files"] = files  # what was written for the first was removed: room for this one
        assert http_call(address, "POST", "/v1/runs", json.dumps(spec).encode())[0] == 201
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


@small_disk
def test_a_gateway_that_starts_on_a_full_disk_says_so_and_leaves_no_temporary_file(
    tmp_path: Path,
) -> None:
    script = (
        'head -c 1M /dev/zero > "$0/filler" 2>/dev/null; '
        f'{sys.executable} -m fnkernel.runtime_server.cli gateway --listen 127.0.0.1:0 --state-dir "$0"; '
        'echo "exit $?"; ls -A "$0"'
    )
    proc = on_a_small_disk(tmp_path / "state", "64k", script)
    out, err = proc.communicate(timeout=60)
    assert "No space left on device" in err, err
    assert "exit 0" not in out and "exit " in out
    assert out.split("\n", 1)[1].split() == ["filler"], out  # no token, and no .token.PID.tmp


def test_a_store_from_before_run_files_keeps_each_runs_files(tmp_path: Path) -> None:
    # docs/architecture.md, "Seams": an fnkernel before 0.4 kept a Run's files in the directory
    # its working_dir column named; opened by this one, the store holds them and the old
    # directory is gone, so no Run is lost to the upgrade and no pod reads the state dir.
    path, old_dir = tmp_path / "runs.db", tmp_path / "workspace" / "uid-1"
    (old_dir / "lib").mkdir(parents=True)
    files = {"handler.py": "def handle(event):\n    return event\n", "lib/util.py": "X = 1\n"}
    for name, text in files.items():
        (old_dir / name).write_text(text)
    old = sqlite3.connect(path)
    old.execute(
        "CREATE TABLE runs (uid TEXT PRIMARY KEY, name TEXT NOT NULL UNIQUE, runtime TEXT NOT NULL,"
        " handler TEXT NOT NULL, source TEXT NOT NULL, working_dir TEXT NOT NULL,"
        " env TEXT NOT NULL, idle_timeout_seconds INTEGER NOT NULL, phase TEXT NOT NULL,"
        " attempt INTEGER NOT NULL, created_at REAL NOT NULL)"
    )
    old.execute(
        "INSERT INTO runs VALUES ('uid-1', 'fn', 'python', 'handler.handle', '2 file(s)', ?,"
        " '{}', 900, 'Ready', 1, 0)",
        (str(old_dir),),
    )
    old.commit()
    old.close()
    store = SqliteRunStore(path)
    try:
        assert store.get("fn").status.phase == "Ready"
        assert store.files("uid-1") == files
        # its spec's digest is that of a Run of these files made today (RunSpec.digest)
        assert store.get("fn").spec.files_sha256 == files_digest(files)
        assert not old_dir.exists()
        store.delete("uid-1")
        with pytest.raises(RunNotFound):
            store.files("uid-1")
    finally:
        store.close()
