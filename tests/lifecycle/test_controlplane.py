"""The control plane (docs/protocol.md, "Runs"): Run creation, the scheduler and the retry engine, against a real
SQLite store. Pods are rows their runtimed would write (heartbeats); no process is needed here."""

from __future__ import annotations

import gc
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from fnkernel.runtime_server.errors import InvalidField, NoRuntimePod, RunAlreadyExists, RunNotFound
from fnkernel.runtime_server.lifecycle import walindex
from fnkernel.runtime_server.lifecycle.controlplane import ControlPlane, RetryPolicy, checked_spec
from fnkernel.runtime_server.lifecycle.runs import POD_GRACE_SECONDS, Run, RunSpec, files_digest
from fnkernel.runtime_server.lifecycle.sqlite import SqliteRunStore
from fnkernel.runtime_server.wire import DELETED, DELETING, FAILED, IDLE, PENDING, READY, RETRYING
from tests.support import wait_until

HANDLER = {"handler.py": "def handle(event):\n    return event\n"}


@pytest.fixture
def plane(tmp_path: Path) -> ControlPlane:
    return ControlPlane(
        SqliteRunStore(tmp_path / "runs.db"),
        policy=RetryPolicy(max_attempts=3, base_backoff=0.0, max_backoff=0.0),
    )


def alive(plane: ControlPlane, *pods: str, healthy: bool = True) -> None:
    for pod in pods:
        plane.store.heartbeat(pod, "python", f"unix:/{pod}", healthy)


def create(plane: ControlPlane, name: str = "fn") -> str:
    return plane.create_run(
        name=name, runtime="python", handler="handler.handle", files=HANDLER
    ).uid


def test_store_is_sqlite_in_wal_mode(plane: ControlPlane) -> None:
    # docs/protocol.md, "Runs": SQLite (stdlib sqlite3, WAL) so that a restart loses nothing.
    mode = sqlite3.connect(plane.store.path).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_create_stores_the_files_and_starts_at_attempt_1(plane: ControlPlane) -> None:
    # docs/architecture.md, "Seams": a Run's files travel in the store; the pod's runtimed
    # writes them, the control plane writes no directory.
    alive(plane, "python-0")
    files = {"handler.py": "def handle(e):\n    return e\n", "lib/util.py": "X = 1\n"}
    run = plane.create_run(name="fn", runtime="python", handler="handler.handle", files=files)
    assert (run.status.phase, run.status.attempt, run.status.assigned_pod) == (
        PENDING,
        1,
        "python-0",
    )
    again = SqliteRunStore(plane.store.path)  # another connection, as after a restart
    assert again.get("fn") == run
    assert again.files(run.uid) == files


def test_scheduler_picks_the_least_loaded_live_pod(plane: ControlPlane) -> None:
    alive(plane, "python-0", "python-1")
    alive(plane, "python-2", healthy=False)
    pods = [plane.store.get_uid(create(plane, f"fn{i}")).status.assigned_pod for i in range(4)]  # type: ignore[union-attr]
    assert sorted(pods) == ["python-0", "python-0", "python-1", "python-1"]


def test_create_without_a_live_pod_is_refused_and_leaves_nothing(plane: ControlPlane) -> None:
    with pytest.raises(NoRuntimePod):
        create(plane)
    assert plane.store.runs() == []
    with pytest.raises(RunNotFound):
        plane.store.get("fn")


def test_a_bad_handler_is_refused_and_nothing_is_stored(plane: ControlPlane) -> None:
    alive(plane, "python-0")
    with pytest.raises(InvalidField) as caught:
        plane.create_run(name="fn", runtime="python", handler="../x.handle", files=HANDLER)
    assert caught.value.field == "handler"
    for handler in ("../x.fn", "/etc/x.fn"):  # a bash script outside its working dir
        with pytest.raises(InvalidField) as caught:
            plane.create_run(name="fn", runtime="bash", handler=handler, files={"x.sh": ""})
        assert caught.value.field == "handler"
    assert plane.store.runs() == []


def test_a_create_is_checked_without_touching_the_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    # docs/kubernetes.md, "What each container may write": the controller and the gateway run
    # with a read-only root and no writable volume, where no temporary directory can be made;
    # a create's checks (the handler's path among them) make none.
    def no_temporary_directory(*args: object, **kwargs: object) -> str:
        raise FileNotFoundError("No usable temporary directory found")

    monkeypatch.setattr(tempfile, "mkdtemp", no_temporary_directory)
    monkeypatch.setattr(tempfile, "mkstemp", no_temporary_directory)

    def spec(runtime: str, handler: str) -> RunSpec:
        return RunSpec(runtime=runtime, handler=handler, files_sha256="")

    files = {"sub/x.sh": "fn() { :; }\n"}
    checked, _ = checked_spec("fn", spec("bash", "sub/x.fn"), files)
    assert checked.files_sha256 == files_digest(files)
    assert checked_spec("fn", spec("python", "handler.handle"), HANDLER)[0].digest()
    for handler in ("../x.fn", "/etc/x.fn"):
        with pytest.raises(InvalidField) as caught:
            checked_spec("fn", spec("bash", handler), {"x.sh": ""})
        assert caught.value.field == "handler"


def test_a_taken_name_with_another_spec_is_refused(plane: ControlPlane) -> None:
    alive(plane, "python-0")
    create(plane)
    for change in ({"files": {"handler.py": "def handle(e):\n    return 2\n"}},
                   {"env": {"A": "1"}}, {"idle_timeout_seconds": 60}):  # fmt: skip
        spec = {"name": "fn", "runtime": "python", "handler": "handler.handle", "files": HANDLER}
        with pytest.raises(RunAlreadyExists):
            plane.create_run(**{**spec, **change})  # type: ignore[arg-type]
    assert len(plane.store.runs()) == 1


def test_a_create_repeated_with_the_same_spec_is_given_the_same_run(plane: ControlPlane) -> None:
    # Its client lost the first answer (the gateway crashed): the repeat is not a name clash.
    alive(plane, "python-0")
    first = create(plane)
    assert create(plane) == first
    assert len(plane.store.runs()) == 1
    run = plane.store.get_uid(first)
    assert run is not None
    plane.store.update(run, phase=DELETING)
    with pytest.raises(RunAlreadyExists):  # unless that Run is going away
        create(plane)


def test_retry_on_the_same_pod_when_it_is_healthy(plane: ControlPlane) -> None:
    # docs/protocol.md: the retry engine advances the attempt before the scheduler (re)assigns a pod.
    alive(plane, "python-0", "python-1")
    run = plane.store.get_uid(create(plane))
    assert run is not None
    plane.store.update(run, phase=RETRYING, message="server died", failed_at=time.time())
    plane.reconcile()
    retried = plane.store.get("fn")
    assert (retried.status.phase, retried.status.attempt, retried.status.assigned_pod) == (
        PENDING,
        2,
        run.status.assigned_pod,
    )


def test_reassignment_when_the_pod_is_unhealthy(plane: ControlPlane) -> None:
    alive(plane, "python-0")
    run = plane.store.get_uid(create(plane))
    assert run is not None
    alive(plane, "python-1")
    alive(plane, "python-0", healthy=False)
    plane.store.update(run, phase=RETRYING, message="server died", failed_at=time.time())
    plane.reconcile()
    retried = plane.store.get("fn")
    assert (retried.status.phase, retried.status.attempt, retried.status.assigned_pod) == (
        PENDING,
        2,
        "python-1",
    )


def test_no_live_pod_means_wait_without_spending_an_attempt(plane: ControlPlane) -> None:
    alive(plane, "python-0")
    run = plane.store.get_uid(create(plane))
    assert run is not None
    alive(plane, "python-0", healthy=False)
    plane.store.update(run, phase=RETRYING, message="server died", failed_at=time.time())
    for _ in range(3):
        plane.reconcile()
    waiting = plane.store.get("fn")
    assert (waiting.status.phase, waiting.status.attempt) == (RETRYING, 1)
    alive(plane, "python-0")
    plane.reconcile()
    assert (plane.store.get("fn").status.phase, plane.store.get("fn").status.attempt) == (
        PENDING,
        2,
    )


def test_retries_are_bounded_by_max_attempts(plane: ControlPlane) -> None:
    alive(plane, "python-0")
    create(plane)
    for expected in (2, 3):
        run = plane.store.get("fn")
        plane.store.update(run, phase=RETRYING, message="worker killed", failed_at=time.time())
        plane.reconcile()
        assert plane.store.get("fn").status.attempt == expected
    run = plane.store.get("fn")
    plane.store.update(run, phase=RETRYING, message="worker killed", failed_at=time.time())
    plane.reconcile()
    final = plane.store.get("fn")
    assert (final.status.phase, final.status.attempt) == (FAILED, 3)
    assert final.status.message == "gave up after 3 registration attempts: worker killed"


def test_backoff_is_exponential_with_a_cap() -> None:
    policy = RetryPolicy(max_attempts=10, base_backoff=0.2, max_backoff=1.0)
    assert [policy.backoff(a) for a in (1, 2, 3, 4, 5)] == [0.2, 0.4, 0.8, 1.0, 1.0]


def test_retry_waits_out_the_backoff(tmp_path: Path) -> None:
    plane = ControlPlane(SqliteRunStore(tmp_path / "runs.db"), policy=RetryPolicy(base_backoff=60))
    alive(plane, "python-0")
    run = plane.store.get_uid(create(plane))
    assert run is not None
    plane.store.update(run, phase=RETRYING, message="x", failed_at=time.time())
    plane.reconcile()
    assert plane.store.get("fn").status.phase == RETRYING  # 60 s have not passed


def test_runs_on_a_dead_pod_move_to_retry(plane: ControlPlane) -> None:
    alive(plane, "python-0")
    run = plane.store.get_uid(create(plane))
    assert run is not None
    plane.store.update(run, phase=READY)
    alive(plane, "python-0", healthy=False)
    alive(plane, "python-1")
    plane.reconcile()  # Ready on a dead pod → Retrying
    plane.reconcile()  # Retrying → attempt 2 on the live pod
    moved = plane.store.get("fn")
    assert (moved.status.phase, moved.status.attempt, moved.status.assigned_pod) == (
        PENDING,
        2,
        "python-1",
    )


def test_an_idle_run_moves_off_a_dead_pod_without_a_new_attempt(plane: ControlPlane) -> None:
    # No registration exists while Idle, so nothing failed: the attempt stays.
    alive(plane, "python-0")
    run = plane.store.get_uid(create(plane))
    assert run is not None
    plane.store.update(run, phase=IDLE)
    alive(plane, "python-0", healthy=False)
    alive(plane, "python-1")
    plane.reconcile()
    moved = plane.store.get("fn")
    assert (moved.status.phase, moved.status.attempt, moved.status.assigned_pod) == (
        IDLE,
        1,
        "python-1",
    )


def counted_passes(plane: ControlPlane) -> list[float]:
    """The times of the loop's passes from now on."""
    passes: list[float] = []
    reconcile = plane.reconcile

    def counted() -> float:
        passes.append(time.monotonic())
        return reconcile()

    plane.reconcile = counted  # type: ignore[method-assign]
    return passes


def test_the_loop_notices_a_heartbeat_running_out_with_no_pass_every_tick(
    plane: ControlPlane, caplog: pytest.LogCaptureFixture
) -> None:
    # docs/architecture.md, "The control plane's pass": a pass reads every Run, so the loop
    # makes one only after a write to the store or when time alone can give it work — here,
    # the pod's last heartbeat going stale one second from now. A pass every 0.1 s tick
    # would make ten or more before that.
    alive(plane, "python-0")
    run = plane.store.update(plane.store.get_uid(create(plane)), phase=READY)  # type: ignore[arg-type]
    assert run is not None
    stale_in_one_second = time.time() - POD_GRACE_SECONDS + 1.0
    SqliteRunStore(plane.store.path)._connection().execute(
        "UPDATE pods SET heartbeat = ?", (stale_in_one_second,)
    )
    passes = counted_passes(plane)
    plane.start()
    try:
        wait_until(lambda: plane.store.get("fn").status.phase != READY, timeout=10)
        assert time.time() >= stale_in_one_second + POD_GRACE_SECONDS  # not before
        moved = plane.store.get("fn")
        assert (moved.status.phase, moved.status.message) == (RETRYING, "pod python-0 stopped")
        # An operator reads it in the log: which Run, which pod, and why.
        assert "run fn: pod python-0 stopped (no heartbeat); it is retried on a live pod" in (
            caplog.text
        )
        # The first pass, the one when the heartbeat ran out, and the one after its own write.
        assert len(passes) <= 4, [round(t - passes[0], 2) for t in passes]
        # A write by another connection is seen in a tick or so, with nothing due by time.
        SqliteRunStore(plane.store.path).update(moved, phase=DELETED)
        wait_until(lambda: plane.store.get_uid(run.uid) is None, timeout=5)
    finally:
        plane.stop()


def test_the_loop_retries_when_the_backoff_ends_with_no_write_to_wake_it(
    tmp_path: Path,
) -> None:
    plane = ControlPlane(
        SqliteRunStore(tmp_path / "runs.db"),
        policy=RetryPolicy(base_backoff=1.0, max_backoff=1.0),
    )
    alive(plane, "python-0")
    run = plane.store.get_uid(create(plane))
    assert run is not None
    failed = plane.store.update(run, phase=RETRYING, message="x", failed_at=time.time())
    assert failed is not None
    passes = counted_passes(plane)
    plane.start()
    try:
        wait_until(lambda: plane.store.get("fn").status.phase == PENDING, timeout=10)
        assert time.time() >= failed.status.failed_at + 1.0
        assert plane.store.get("fn").status.attempt == 2
        assert len(passes) <= 4, [round(t - passes[0], 2) for t in passes]
    finally:
        plane.stop()


def test_status_writes_are_fenced_on_attempt_and_pod(plane: ControlPlane) -> None:
    # A late writer that saw attempt 1 cannot overwrite what attempt 2 decided.
    alive(plane, "python-0")
    seen = plane.store.get_uid(create(plane))
    assert seen is not None
    plane.store.update(seen, attempt=2)
    assert plane.store.update(seen, phase=FAILED, message="late") is None
    assert plane.store.get("fn").status.phase == PENDING


def test_store_version_changes_with_another_connections_write(plane: ControlPlane) -> None:
    # RunStore.version: what runtimed's loop and wait_settled ask before reading every Run
    # again, so a write by any other connection (another process) must change it.
    seen = plane.store.version()
    assert plane.store.version() == seen  # nothing written meanwhile
    other = SqliteRunStore(plane.store.path)
    other.heartbeat("python-9", "python", "unix:/nowhere", True)
    changed = plane.store.version()
    assert changed != seen
    assert plane.store.version() == changed  # each write is seen once
    other.heartbeat("python-9", "python", "unix:/nowhere", False)
    assert plane.store.version() != changed  # and every write is seen


def test_store_version_ignores_its_own_connections_writes(plane: ControlPlane) -> None:
    # "it changes only with *other* connections' writes, so runtimed's own heartbeat does not
    # wake its loop" (docs/architecture.md, "The proxy hop"), though it rewrites the WAL-index
    # header that version() compares first.
    seen = plane.store.version()
    plane.store.heartbeat("python-9", "python", "unix:/nowhere", True)
    assert plane.store.version() == seen


def test_wait_settled_sees_another_processes_write_at_once(plane: ControlPlane) -> None:
    alive(plane, "python-0")
    files = {"handler.py": "def handle(e):\n    return e\n"}
    run = plane.create_run(name="fn", runtime="python", handler="handler.handle", files=files)
    other = SqliteRunStore(plane.store.path)
    threading.Timer(0.2, lambda: other.update(run, phase=READY)).start()
    started = time.monotonic()
    assert plane.wait_settled("fn", timeout=120).status.phase == READY
    assert time.monotonic() - started < 60  # at the write (0.2 s), not at the timeout


def test_fresh_reads_see_every_write_their_own_and_others(plane: ControlPlane) -> None:
    # SqliteRunStore.fresh: the proxy hop's fence reads through it on every call, so a write by this
    # thread (its own connection) and by any other connection must both show at once.
    alive(plane, "python-0")
    files = {"handler.py": "def handle(e):\n    return e\n"}
    run = plane.create_run(name="fn", runtime="python", handler="handler.handle", files=files)
    store = plane.store
    assert store.get_uid_fresh(run.uid) == run and store.get_fresh("fn") == run
    own = store.update(run, phase=READY)
    assert own is not None
    assert store.get_uid_fresh(run.uid) == own and store.get_fresh("fn") == own
    other = SqliteRunStore(store.path).update(own, phase=IDLE)
    assert other is not None
    assert store.get_uid_fresh(run.uid) == other and store.get_fresh("fn") == other
    assert store.pod_fresh("python-0") is not None and store.pod_fresh("nowhere") is None


def test_fresh_reads_of_an_unchanged_store_run_no_sql(plane: ControlPlane) -> None:
    # docs/architecture.md, "The proxy hop": whether anything changed is read from the WAL-index
    # header in shared memory; a SQL statement per call cost the proxy hop ~150 us of CPU.
    run = create_ready(plane)
    store = plane.store
    statements: list[str] = []
    store._connection().set_trace_callback(statements.append)
    try:
        for _ in range(100):
            assert store.get_uid_fresh(run.uid) == run
    finally:
        store._connection().set_trace_callback(None)
    assert statements == [f"SELECT * FROM runs WHERE uid = '{run.uid}'"]  # the first read only


def test_a_row_read_by_one_thread_serves_every_thread_until_the_next_write(
    plane: ControlPlane,
) -> None:
    # docs/architecture.md, "The proxy hop": runtimed answers from a pool of threads, and a
    # heartbeat is written every second; with a cache per thread, each write made every thread
    # read every Run again, and under load nearly every call read its row.
    run = create_ready(plane)
    store = plane.store
    assert store.get_uid_fresh(run.uid) == run  # read by this thread

    def read_in_a_new_thread() -> list[str]:
        statements: list[str] = []

        def read() -> None:
            store._connection().set_trace_callback(statements.append)
            assert store.get_uid_fresh(run.uid) is not None

        reader = threading.Thread(target=read)
        reader.start()
        reader.join(10)
        return statements

    assert read_in_a_new_thread() == []  # served from the first thread's read
    written = SqliteRunStore(store.path).update(run, message="written elsewhere")
    assert written is not None
    assert read_in_a_new_thread() == [f"SELECT * FROM runs WHERE uid = '{run.uid}'"]
    assert store.get_uid_fresh(run.uid) == written  # and that read serves this thread


def test_fresh_reads_see_a_later_write_when_the_store_was_opened_by_a_finished_thread(
    plane: ControlPlane,
) -> None:
    # SQLite removes the -shm file the header is read from when its last connection closes, and
    # a thread's connection closes when the thread ends: the store keeps the one it was opened
    # with, so the file it maps stays the one every later writer writes.
    run = create_ready(plane)
    opened: list[SqliteRunStore] = []
    opener = threading.Thread(target=lambda: opened.append(SqliteRunStore(plane.store.path)))
    opener.start()
    opener.join()
    gc.collect()  # what closes the finished thread's connection
    plane.store.close()  # the fixture's store: no other connection of this process is left open
    store = opened[0]
    assert store.get_uid_fresh(run.uid) == run
    write = (
        "import sqlite3, sys; db = sqlite3.connect(sys.argv[1]); "
        "db.execute(\"UPDATE runs SET message = 'from another process'\"); db.commit()"
    )
    subprocess.run([sys.executable, "-c", write, str(store.path)], check=True, timeout=60)
    assert store.get_uid_fresh(run.uid).status.message == "from another process"  # type: ignore[union-attr]


# Asked from another process (a process never sees its own locks): does anyone hold SQLite's
# in-use lock on the store's -shm file (byte 128)? A connection that finds it free takes itself
# for the first, truncates the -shm file and rebuilds the WAL index (docs/architecture.md,
# "Measured facts the design rests on").
SHM_IN_USE = """
import fcntl, os, struct, sys
fd = os.open(sys.argv[1] + "-shm", os.O_RDONLY)
probe = struct.pack("hhqqi", fcntl.F_WRLCK, os.SEEK_SET, 128, 1, 0)
print(struct.unpack("hhqqi", fcntl.fcntl(fd, fcntl.F_GETLK, probe))[0] != fcntl.F_UNLCK)
"""


def shm_in_use(store: SqliteRunStore) -> bool:
    probe = [sys.executable, "-c", SHM_IN_USE, str(store.path)]
    answer = subprocess.run(probe, capture_output=True, text=True, check=True, timeout=60)
    return answer.stdout.strip() == "True"


def test_an_open_store_keeps_its_shm_file_marked_in_use(tmp_path: Path) -> None:
    # Reading the WAL-index header must not cost the store SQLite's lock on the -shm file:
    # without it, the next process to open the store truncated the file under the others, and a
    # runtimed touching the WAL index through SQLite died of SIGBUS.
    store = SqliteRunStore(tmp_path / "runs.db")
    store.heartbeat("python-0", "python", "unix:/nowhere", True)
    assert store._wal_header is not None  # the header is mapped: the case that lost the lock
    assert shm_in_use(store)
    # A second store of the same file in this process, opened and closed, leaves it so too.
    second = SqliteRunStore(store.path)
    assert second.pod_fresh("python-0") is not None
    second.close()
    del second
    gc.collect()
    assert shm_in_use(store)
    assert store.pod_fresh("python-0") is not None


def create_ready(plane: ControlPlane) -> Run:
    alive(plane, "python-0")
    run = plane.store.update(
        plane.create_run(name="fn", runtime="python", handler="handler.handle", files=HANDLER),
        phase=READY,
    )
    assert run is not None
    return run


@pytest.mark.timeout(30)
def test_a_store_collected_while_its_thread_maps_a_header_does_not_wait_for_itself(
    tmp_path: Path,
) -> None:
    # The garbage collector runs a store's finalizer in whichever thread allocates when it
    # runs, one mapping another store's WAL-index header too, while it holds the headers' lock
    # (walindex.WalHeaders.give_back): the finalizer must not wait for that lock — it had hung
    # a thread of this suite for good — and the header is unmapped by the next map, once.
    first = SqliteRunStore(tmp_path / "runs.db")
    first.heartbeat("python-0", "python", "unix:/nowhere", True)
    assert first._wal_header is not None
    headers = walindex.WAL_HEADERS
    [key] = [key for key, entry in headers._mapped.items() if entry.header is first._wal_header]
    second = SqliteRunStore(first.path)
    assert headers._mapped[key].users == 2
    with headers._lock:  # as map holds it when the collector runs
        del first
        gc.collect()
    assert headers._mapped[key].users == 2  # only given back
    third = SqliteRunStore(second.path)  # its map unmaps the first's
    assert headers._mapped[key].users == 2
    assert third.pod_fresh("python-0") is not None and shm_in_use(third)
    second.close()
    third.close()
    assert key not in headers._mapped  # the last one closed the file
