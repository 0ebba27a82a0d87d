"""Named secrets by reference (docs/protocol.md, "Secrets"): kept by the stack, used by a Run by
name, seen by its handler as environment variables, and nowhere else — tried on the store
itself and on a stack of real processes through the CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.client.errors import GatewayError
from fnkernel.runtime_server.errors import InvalidField, SecretNotFound
from fnkernel.runtime_server.lifecycle.secrets import SecretFiles, rotated_secret
from fnkernel.runtime_server.lifecycle.stack import Stack
from tests.lifecycle.stack_calls import phase_and_attempt
from tests.support import http_call, wait_until

VALUE = "s3cr3t-Value-8842"  # what must appear nowhere but in the handler's environment
ROTATED = "r0tated-Value-1177"
HANDLER = {
    "handler.py": (
        "import hashlib, os\n"
        "def handle(event):\n"
        "    seen = os.environ.get(event.get('key', 'PASSWORD'), '')\n"
        "    return {'user': os.environ.get('DB_USER'),\n"
        "            'sha256': hashlib.sha256(seen.encode()).hexdigest()}\n"
    )
}


def sha256(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()


def fnkernel(gateway: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fnkernel.runtime_server.cli", *args, "--gateway", gateway],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_the_store_keeps_each_secret_private_and_versioned(tmp_path: Path) -> None:
    secrets = SecretFiles(tmp_path / "state" / "secrets")
    first = secrets.set("warehouse", {"DB_USER": "alice", "PASSWORD": VALUE})
    assert (first.version, first.keys) == ("1", ("DB_USER", "PASSWORD"))
    assert secrets.set("warehouse", {"PASSWORD": ROTATED}).version == "2"
    assert secrets.get("warehouse").data == {"PASSWORD": ROTATED}  # replaced whole
    kept = tmp_path / "state" / "secrets"
    assert kept.stat().st_mode & 0o777 == 0o700
    assert (kept / "warehouse").stat().st_mode & 0o777 == 0o600
    (listed,) = secrets.list()
    assert (listed.name, listed.version, listed.keys, dict(listed.data)) == (
        "warehouse", "2", ("PASSWORD",), {},
    )  # fmt: skip
    assert VALUE not in repr(listed) and ROTATED not in repr(secrets.get("warehouse"))
    secrets.delete("warehouse")
    with pytest.raises(SecretNotFound, match="'warehouse' does not exist"):
        secrets.get("warehouse")
    # Set again after a delete, it has a version it never had: a Run that used it sees a change.
    assert secrets.set("warehouse", {"PASSWORD": VALUE}).version == "3"
    # Versions are the store's: another secret's set takes the next one too.
    assert secrets.set("lake", {"K": "v"}).version == "4"
    # README, "Security": a looser file (an older store's, a chmod) is made 0600 as it is
    # read; a link in the store's place is never read through.
    (kept / "lake").chmod(0o644)
    assert secrets.get("lake").data == {"K": "v"}
    assert (kept / "lake").stat().st_mode & 0o777 == 0o600
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text('{"version": 9, "data": {"K": "planted"}}')
    (kept / "planted").symlink_to(elsewhere)
    with pytest.raises(OSError):
        secrets.get("planted")


def test_a_poll_reads_each_secret_once_however_many_runs_use_it(tmp_path: Path) -> None:
    # docs/protocol.md, "Secrets": runtimed sees a rotation at its next poll; a poll reads each
    # secret once (on Kubernetes a GET each), not once for every Run that uses it.
    store = SecretFiles(tmp_path)
    store.set("warehouse", {"K": "v"})  # version 1
    store.set("lake", {"K": "v"})  # version 2: the store's next
    reads: list[str] = []

    class Counting:
        def get(self, name: str) -> Any:
            reads.append(name)
            return store.get(name)

    counting: Any = Counting()
    seen: dict[str, str | None] = {}
    assert rotated_secret(counting, {"warehouse": "1", "lake": "2"}, seen) == ""
    assert rotated_secret(counting, {"warehouse": "1"}, seen) == ""
    store.set("warehouse", {"K": "w"})
    assert rotated_secret(counting, {"warehouse": "1", "lake": "2"}, seen) == ""  # this poll's
    assert sorted(reads) == ["lake", "warehouse"]
    assert rotated_secret(counting, {"warehouse": "1"}) == (
        "secret 'warehouse' changed (version 1 → 3)"
    )
    store.delete("lake")
    assert rotated_secret(counting, {"lake": "2"}) == "secret 'lake' was deleted"


def _set_many(directory: str, times: int, go: Any) -> None:
    go.wait(30)
    for n in range(times):
        SecretFiles(Path(directory)).set("warehouse", {"N": str(n)})


def test_every_set_gets_a_version_of_its_own_across_processes(tmp_path: Path) -> None:
    # docs/protocol.md, "Secrets": each set gives the secret a new version, which is how a Run
    # learns of a rotation — also when the gateway and `fnkernel secrets` on this machine set
    # it at the same moment (two processes here, each setting it 150 times).
    import multiprocessing

    spawn = multiprocessing.get_context("spawn")
    go = spawn.Event()
    setters = [spawn.Process(target=_set_many, args=(str(tmp_path), 150, go)) for _ in range(2)]
    for setter in setters:
        setter.start()
    go.set()
    for setter in setters:
        setter.join(60)
        assert setter.exitcode == 0
    assert SecretFiles(tmp_path).get("warehouse").version == "300"
    assert [s.name for s in SecretFiles(tmp_path).list()] == ["warehouse"]


def test_with_no_gateway_named_the_cli_keeps_secrets_in_this_machines_store(
    tmp_path: Path,
) -> None:
    # docs/protocol.md, "Secrets": `fnkernel secrets` with neither --gateway nor
    # $FNKERNEL_RUNTIME acts on this machine's store in the state dir — where the embedded
    # runtime and `fnkernel up` read them — answering as the gateway does.
    env = {k: v for k, v in os.environ.items() if k not in ("FNKERNEL_RUNTIME", "FNKERNEL_TOKEN")}
    env["FNKERNEL_STATE_DIR"] = str(tmp_path / "state")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "fnkernel.runtime_server.cli", *args],
                              capture_output=True, text=True, timeout=60, env=env)  # fmt: skip

    made = cli("secrets", "set", "warehouse", "DB_USER=alice", f"PASSWORD={VALUE}")
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout) == {"name": "warehouse", "version": "1",
                                       "keys": ["DB_USER", "PASSWORD"]}  # fmt: skip
    kept = SecretFiles(tmp_path / "state" / "secrets").get("warehouse")
    assert kept.data == {"DB_USER": "alice", "PASSWORD": VALUE}
    assert cli("secrets", "list").stdout.splitlines() == [
        "NAME       VERSION  KEYS",
        "warehouse  1        DB_USER,PASSWORD",
    ]
    # A state dir another user made, or may write, is refused as `fnkernel up` refuses it
    # (README, "Security"): nothing is written into it.
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    refused = subprocess.run(
        [sys.executable, "-m", "fnkernel.runtime_server.cli", "secrets", "set", "x", "A=b"],
        capture_output=True, text=True, timeout=60, env={**env, "FNKERNEL_STATE_DIR": str(loose)},
    )  # fmt: skip
    assert refused.returncode == 2 and "lets its group and others write into it" in refused.stderr
    assert list(loose.iterdir()) == []
    # --secrets-dir is checked itself, as up checks it: one of the user's own in /tmp is fine.
    own = Path(tempfile.mkdtemp(prefix="fnkernel-secrets-", dir="/tmp"))
    try:
        kept = cli("secrets", "set", "x", "A=b", "--secrets-dir", str(own))
        assert kept.returncode == 0, kept.stderr
        assert (own / "x").stat().st_mode & 0o777 == 0o600
    finally:
        shutil.rmtree(own)
    bad = cli("secrets", "set", "Warehouse", f"PASSWORD={VALUE}")
    assert bad.returncode == 2 and "name: must be 1-63 lower-case" in bad.stderr
    assert VALUE not in bad.stderr + made.stdout
    assert cli("secrets", "delete", "warehouse").returncode == 0
    gone = cli("secrets", "delete", "warehouse")
    assert gone.returncode == 1
    assert gone.stderr.strip() == "fnkernel: SecretNotFound: secret 'warehouse' does not exist"
    elsewhere = cli("secrets", "set", "other", "K=v", "--secrets-dir", str(tmp_path / "mine"))
    assert elsewhere.returncode == 0 and SecretFiles(tmp_path / "mine").get("other").data == {
        "K": "v"
    }


def test_a_key_alone_takes_its_value_from_the_environment_out_of_the_process_list(
    tmp_path: Path,
) -> None:
    # docs/protocol.md, "Secrets": `KEY` with no `=VALUE` takes the value of `$KEY` in the
    # environment of `fnkernel secrets set` (as `%%function --env KEY` does), and
    # `--from-env-file -` reads the env file from stdin: either way the value is in no command
    # line. A KEY the environment does not have is a usage error naming it, and nothing is set.
    env = {k: v for k, v in os.environ.items() if k not in ("FNKERNEL_RUNTIME", "FNKERNEL_TOKEN")}
    env |= {"FNKERNEL_STATE_DIR": str(tmp_path / "state"), "PASSWORD": VALUE}

    def cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "fnkernel.runtime_server.cli", *args],
                              capture_output=True, text=True, timeout=60, env=env,
                              input=stdin)  # fmt: skip

    store = SecretFiles(tmp_path / "state" / "secrets")
    made = cli("secrets", "set", "warehouse", "DB_USER=alice", "PASSWORD")
    assert made.returncode == 0, made.stderr
    assert store.get("warehouse").data == {"DB_USER": "alice", "PASSWORD": VALUE}
    piped = cli("secrets", "set", "other", "--from-env-file", "-", stdin=f"TOKEN={ROTATED}\n")
    assert piped.returncode == 0, piped.stderr
    assert store.get("other").data == {"TOKEN": ROTATED}
    unset = cli("secrets", "set", "third", "DB_USER=bob", "MISSING_KEY_1")
    assert unset.returncode == 2
    assert "argument 2 after the name, MISSING_KEY_1, is not set in this environment" in (
        unset.stderr
    )
    assert [secret.name for secret in store.list()] == ["other", "warehouse"]


@pytest.mark.parametrize(
    ("name", "data", "says"),
    [
        ("Warehouse", {"K": "v"}, "name: must be 1-63 lower-case"),
        ("warehouse", {}, "data: must be an object of at least one"),
        ("warehouse", {"1KEY": VALUE}, "data: key '1KEY' is not an environment variable name"),
        ("warehouse", {"KEY": VALUE + "\0"}, "data.KEY: must be text without NUL"),
    ],
)
def test_a_bad_secret_is_refused_naming_the_field_never_the_value(
    tmp_path: Path, name: str, data: dict[str, str], says: str
) -> None:
    with pytest.raises(InvalidField) as refused:
        SecretFiles(tmp_path).set(name, data)
    assert str(refused.value).startswith(says) and VALUE not in str(refused.value)


def test_a_handler_sees_a_secrets_keys_and_a_rotation_registers_it_again(
    stack_factory: Callable[..., Stack], tmp_path: Path
) -> None:
    stack = stack_factory({"python": 1}, state_dir=tmp_path / "state")
    gateway, client = stack.gateway_address, Client(stack.gateway_address)
    env_file = tmp_path / ".env"
    env_file.write_text(f"# the warehouse\nexport DB_USER=alice\nPASSWORD='{VALUE}'\n")
    made = fnkernel(gateway, "secrets", "set", "warehouse", "--from-env-file", str(env_file))
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout) == {
        "name": "warehouse",
        "version": "1",
        "keys": ["DB_USER", "PASSWORD"],
    }
    listed = fnkernel(gateway, "secrets", "list")  # a table, as `runs list` is
    assert listed.stdout.splitlines()[1].split() == ["warehouse", "1", "DB_USER,PASSWORD"]

    run = client.create_run("etl", runtime="python", handler="handler.handle", files=HANDLER,
                            secrets=["warehouse"])  # fmt: skip
    assert run.phase == "Ready", run.message
    assert run["spec"]["secrets"] == ["warehouse"]
    assert client.invoke("etl", {}).value() == {"user": "alice", "sha256": sha256(VALUE)}

    rotated = fnkernel(
        gateway, "secrets", "set", "warehouse", "DB_USER=alice", f"PASSWORD={ROTATED}"
    )
    assert json.loads(rotated.stdout)["version"] == "2"
    # runtimed sees another version at its next poll: a new attempt with the new value
    wait_until(lambda: client.status("etl").attempt == 2 and client.status("etl").phase == "Ready",
               timeout=30)  # fmt: skip
    assert client.invoke("etl", {}).value()["sha256"] == sha256(ROTATED)

    # What a user, or another local user, can read holds no value: the Run, the store of
    # Runs, every other file of the state dir, the components' logs.
    shown = json.dumps(client.status("etl")) + json.dumps(client.list_secrets())
    assert VALUE not in shown and ROTATED not in shown
    for path in (tmp_path / "state").rglob("*"):
        if path.is_file() and "secrets" not in path.relative_to(tmp_path / "state").parts:
            data = path.read_bytes()
            assert VALUE.encode() not in data and ROTATED.encode() not in data, path


def test_calls_made_while_a_rotation_registers_the_run_again_wait_for_it(
    stack_factory: Callable[..., Stack],
) -> None:
    # docs/protocol.md, "Secrets": a rotated key reaches the handler within about a poll
    # interval, by a new registration; meanwhile the Run's calls are refused before they run
    # (503, Retry-After: "Errors"), and the client sends them again once it is ready, up to
    # each call's timeout — a notebook calling in a loop sees no failure, only the new key.
    stack = stack_factory({"python": 1})
    client = Client(stack.gateway_address)
    client.set_secret("warehouse", {"DB_USER": "alice", "PASSWORD": VALUE})
    client.create_run("etl", runtime="python", handler="handler.handle", files=HANDLER,
                      secrets=["warehouse"])  # fmt: skip
    seen: list[str] = []
    failures: list[Exception] = []
    stop = threading.Event()

    def calls() -> None:
        for _ in range(20_000):  # bounded: ~1 ms each, and the test's timeout
            if stop.is_set():
                return
            try:
                seen.append(client.invoke("etl", {}).value()["sha256"])
            except GatewayError as exc:
                failures.append(exc)
            if seen and seen[-1] == sha256(ROTATED):
                return

    caller = threading.Thread(target=calls)
    caller.start()
    try:
        wait_until(lambda: len(seen) >= 20, timeout=30)
        client.set_secret("warehouse", {"DB_USER": "alice", "PASSWORD": ROTATED})
        caller.join(timeout=60)
    finally:
        stop.set()
        caller.join()
    assert failures == []
    assert seen[0] == sha256(VALUE) and seen[-1] == sha256(ROTATED)
    assert client.status("etl").attempt == 2  # it was registered again meanwhile


def test_a_missing_secret_fails_the_registration_naming_it(
    stack_factory: Callable[..., Stack], tmp_path: Path
) -> None:
    stack = stack_factory({"python": 1}, state_dir=tmp_path / "state")
    client = Client(stack.gateway_address)
    run = client.create_run("lost", runtime="python", handler="handler.handle", files=HANDLER,
                            secrets=["nowhere"])  # fmt: skip
    assert run.phase == "Failed" and run.attempt == 1
    assert run.message == "secret 'nowhere' does not exist"
    with pytest.raises(GatewayError, match=r"; the Run stays Failed until its secrets are set"):
        client.invoke("lost", {})
    gone = fnkernel(stack.gateway_address, "secrets", "delete", "nowhere")
    # Through the gateway as on the secrets' directory: the class says what is not found.
    assert gone.returncode == 1
    assert "SecretNotFound: secret 'nowhere' does not exist" in gone.stderr, gone.stderr
    # docs/protocol.md, "Secrets": once the secret is set, the Run is registered again (an
    # attempt not charged); deleted, it fails again; set again, it serves again. It stayed
    # Failed for good, though the message said it would stay so "until it is made again".
    for attempt, user in ((2, "bob"), (4, "carol")):
        made = fnkernel(stack.gateway_address, "secrets", "set", "nowhere", f"DB_USER={user}",
                        f"PASSWORD={VALUE}")  # fmt: skip
        assert made.returncode == 0, made.stderr
        wait_until(lambda: phase_and_attempt(client, "lost") == ("Ready", attempt), timeout=30)  # noqa: B023
        assert client.invoke("lost", {}).value() == {"user": user, "sha256": sha256(VALUE)}
        if attempt == 2:
            gone = fnkernel(stack.gateway_address, "secrets", "delete", "nowhere")
            assert gone.returncode == 0, gone.stderr
            wait_until(lambda: client.status("lost").phase == "Failed", timeout=30)
            assert client.status("lost").message == "secret 'nowhere' does not exist"


def test_an_env_file_is_read_as_dotenv_reads_it() -> None:
    # docs/protocol.md, "Secrets": `--from-env-file` takes KEY=VALUE lines, `export` and quotes,
    # `#` comments — as a .env file copied from dotenv or Docker Compose means them.
    from fnkernel.runtime_server.cli.common import UsageError
    from fnkernel.runtime_server.cli.secrets import env_file

    text = (
        '# the warehouse\n\nexport TOKEN="tok en#1"  # issued in May\n'
        "PLAIN=val # a comment\nQUOTED='single $HOME' \nSPACED=a b  c\n"
        'KEY="-----BEGIN KEY-----\nMIIB\n-----END KEY-----"\nESCAPED="a\\"b\\n"\nEMPTY=\n'
    )
    assert env_file(text) == {
        "TOKEN": "tok en#1", "PLAIN": "val", "QUOTED": "single $HOME", "SPACED": "a b  c",
        "KEY": "-----BEGIN KEY-----\nMIIB\n-----END KEY-----", "ESCAPED": 'a"b\n', "EMPTY": "",
    }  # fmt: skip
    for bad, line in ((f"A=1\n{VALUE}\n", 2), ("A=1\n\nNOVALUE\n", 3)):
        with pytest.raises(UsageError) as refused:
            env_file(bad)
        assert str(refused.value) == f"--from-env-file: line {line} is not KEY=VALUE"


def test_a_secrets_unknown_field_over_http_is_refused_naming_it(shared_stack: Stack) -> None:
    # docs/protocol.md, "HTTP API": a field a request does not take is 400 naming it, as a
    # Run's is — not ignored (a misspelt "data" would set nothing the caller meant).
    status, _, body = http_call(
        shared_stack.gateway_address, "PUT", "/v1/secrets/typo",
        json.dumps({"data": {"A": "b"}, "extra": 1}).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    assert status == 400
    assert json.loads(body)["message"] == "extra: is not a field of a secret; its field: data"
    assert "typo" not in [
        secret["name"] for secret in Client(shared_stack.gateway_address).list_secrets()
    ]
