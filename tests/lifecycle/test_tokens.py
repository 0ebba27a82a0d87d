"""README, "Security": the gateway's bearer token — required on every TCP listener, found by
clients on the gateway's machine, trimmed, never quoted — and what a client or the CLI does with
a wrong or missing one. Against real gateway processes."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import urllib.parse
from pathlib import Path

import pytest

from fnkernel.runtime_server import tokens
from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.client.errors import Unauthorized
from fnkernel.runtime_server.daemon import spawn
from fnkernel.runtime_server.lifecycle.stack import Stack
from tests.support import http_call, read_until_ready


def test_a_tcp_gateway_requires_a_token_by_default(shared_stack: Stack) -> None:
    status, headers, _ = http_call(
        shared_stack.gateway_address, "GET", "/v1/runs", authenticate=False
    )
    assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
    token_file = shared_stack.state_dir / "token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert token_file.read_text().strip() == shared_stack.token


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_the_bearer_scheme_is_case_insensitive(shared_stack: Stack, scheme: str) -> None:
    # RFC 9110 §11.1: authentication schemes are case-insensitive.
    headers = {"Authorization": f"{scheme} {shared_stack.token}"}
    assert http_call(shared_stack.gateway_address, "GET", "/v1/runs", headers=headers)[0] == 200


def test_a_wrong_token_is_401_and_the_client_says_unauthorized(shared_stack: Stack) -> None:
    with pytest.raises(Unauthorized) as refused:
        Client(shared_stack.gateway_address, token="not-the-token").list_runs()
    # What a notebook's cell shows (IPython renders it so): the refusal, and where a client
    # finds the token (README, "Security"), as the CLI says.
    first, where = refused.value._render_traceback_()
    assert first.startswith("Unauthorized: ") and "(UNAUTHENTICATED)" in first
    assert "$FNKERNEL_TOKEN" in where and "$FNKERNEL_RUNTIME_DIR" in where


def test_a_token_is_trimmed_and_one_holding_a_control_character_is_refused_unquoted(
    shared_stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    # README, "Security": `export FNKERNEL_TOKEN=$(cat token)` of a CRLF file keeps its `\r`:
    # the client trims it, as it trims a token file. A control character inside is refused
    # before anything is sent, naming where the token came from and never quoting it — it
    # would land in a notebook or a CI log.
    address, token = shared_stack.gateway_address, shared_stack.token
    assert token
    monkeypatch.setenv("FNKERNEL_TOKEN", f"{token}\r\n")
    assert isinstance(Client(address).list_runs(), list)
    assert isinstance(Client(address, token=f"{token}\n").list_runs(), list)
    monkeypatch.setenv("FNKERNEL_TOKEN", f"{token}\x01")
    for made, source in (
        (lambda: Client(address), "$FNKERNEL_TOKEN"),
        (lambda: Client(address, token=f"{token[:4]}\r{token[4:]}"), "the token given"),
    ):
        with pytest.raises(ValueError) as refused:
            made()
        assert str(refused.value) == f"{source} holds a control character, which no token has"


def test_a_client_given_the_token_by_position_says_only_that() -> None:
    # README, "Client library": Client(address=None, *, token=None, ...): the token is given by
    # name. By position it is Python's TypeError, and nothing else (no "Exception ignored"
    # from the half-made object's finalizer on stderr).
    code = (
        "from fnkernel.runtime_server.client import Client\n"
        "try:\n    Client('http://127.0.0.1:1', 'tok')\n"
        "except TypeError as exc:\n    print(type(exc).__name__)\n"
    )
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (ran.returncode, ran.stdout, ran.stderr) == (0, "TypeError\n", "")


def test_clients_find_the_token_and_the_gateway_file_goes_with_the_gateway(
    tmp_path: Path,
) -> None:
    gateway = spawn(["gateway", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "s")])
    try:
        files = list(tokens.runtime_dir().glob(f"gateway-{gateway.pid}.json"))
        assert len(files) == 1
        assert stat.S_IMODE(files[0].stat().st_mode) == 0o600
        assert stat.S_IMODE(files[0].parent.stat().st_mode) == 0o700
        # The CLI, given the address only, authenticates with it.
        port = urllib.parse.urlsplit(gateway.address).port
        listed = subprocess.run(
            [sys.executable, "-m", "fnkernel.runtime_server.cli", "runs", "list",
             "--gateway", f"http://localhost:{port}"],
            capture_output=True, text=True, timeout=60, env={**os.environ, "FNKERNEL_TOKEN": ""},
        )  # fmt: skip
        assert listed.returncode == 0, listed.stderr
        assert listed.stdout.startswith("NAME")
    finally:
        assert gateway.stop() == 0
    assert not files[0].exists()


def test_a_client_that_found_the_token_finds_the_new_one_when_the_gateway_starts_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # README, "Security": clients find the token in the gateway file themselves. A gateway
    # started again (fnkernel up after down, the same state dir) has a new one: a notebook's
    # kernel, open across the restart, finds it too — every call was 401 until it restarted.
    # A token given is the caller's: refused, it is not replaced.
    monkeypatch.delenv(tokens.TOKEN_ENV, raising=False)
    with socket.socket() as probe:  # a port to start the gateway on twice
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = ["gateway", "--listen", f"127.0.0.1:{port}", "--state-dir", str(tmp_path / "s")]
    gateway = spawn(command)
    try:
        found = Client(f"http://localhost:{port}")
        given = Client(f"http://localhost:{port}", token=found.token)
        assert found.list_runs() == [] and given.list_runs() == []
        first = found.token
    finally:
        assert gateway.stop() == 0
    gateway = spawn(command)
    try:
        assert found.list_runs() == []  # refused once, then sent again with the new token
        assert found.token not in (None, first)
        with pytest.raises(Unauthorized):
            given.list_runs()
    finally:
        assert gateway.stop() == 0


def test_no_token_is_for_loopback_only_and_warns(tmp_path: Path) -> None:
    log = tmp_path / "gateway.log"
    with log.open("w") as stderr:
        gateway = spawn(
            ["gateway", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "s"),
             "--no-token"], stderr=stderr,
        )  # fmt: skip
    try:
        status = http_call(gateway.address, "GET", "/v1/runs", authenticate=False)[0]
        assert status == 200
    finally:
        gateway.stop()
    assert "WARNING: --no-token" in log.read_text()


def test_token_gateway_rejects_requests_without_bearer_401(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    # README, "Security": a token file every user may read is refused, naming it: with the
    # token, any of them could run code as the gateway's user.
    token_file.chmod(0o644)
    loose = subprocess.run(
        [sys.executable, "-m", "fnkernel.runtime_server.cli", "gateway", "--listen",
         "127.0.0.1:0", "--state-dir", str(tmp_path / "state"), "--token-file", str(token_file)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert loose.returncode == 2
    assert f"--token-file {token_file}: every user of this machine may read it" in loose.stderr
    token_file.chmod(0o640)  # its group may: a Kubernetes Secret's volume (fsGroup)
    gateway = spawn(
        ["gateway", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "state"),
         "--token-file", str(token_file)]
    )  # fmt: skip
    try:
        status, headers, body = http_call(gateway.address, "GET", "/v1/runs", authenticate=False)
        assert status == 401
        assert headers["WWW-Authenticate"] == "Bearer"
        assert json.loads(body)["code"] == "UNAUTHENTICATED"
        wrong = http_call(gateway.address, "GET", "/v1/runs", headers={"Authorization": "Bearer x"})
        assert wrong[0] == 401
        ok = http_call(
            gateway.address, "GET", "/v1/runs", headers={"Authorization": "Bearer s3cret"}
        )
        assert ok[0] == 200
        assert Client(gateway.address, token="s3cret").list_runs() == []
        # The CLI without the token says where a token is found, not only that it is missing.
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir(mode=0o700)
        env = {k: v for k, v in os.environ.items() if k != "FNKERNEL_TOKEN"}
        cli = subprocess.run(
            [sys.executable, "-m", "fnkernel.runtime_server.cli", "runs", "list", "--gateway",
             gateway.address],
            capture_output=True, text=True, timeout=60,
            env={**env, "FNKERNEL_RUNTIME_DIR": str(elsewhere)},
        )  # fmt: skip
        assert cli.returncode == 1 and "Unauthorized" in cli.stderr, cli.stderr
        assert "--token-file STATE_DIR/token" in cli.stderr and "FNKERNEL_TOKEN" in cli.stderr
    finally:
        assert gateway.stop() == 0


def test_non_loopback_gateway_refuses_to_start_without_a_token(tmp_path: Path) -> None:
    # README, "Security": --no-token is for loopback only. It refuses before binding anything.
    result = subprocess.run(
        [sys.executable, "-m", "fnkernel.runtime_server.cli", "gateway", "--listen", "0.0.0.0:0",
         "--state-dir", str(tmp_path / "state"), "--no-token"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--no-token" in result.stderr


def test_up_says_where_its_new_token_is_and_never_the_token(tmp_path: Path) -> None:
    # README, "Security": `fnkernel up` stores a new token in STATE_DIR/token (0600) and says
    # where, never the token itself: README's own `fnkernel up > up.log` (and any log of its
    # stderr) is a file of the umask's mode, which another local user may read.
    state, said = tmp_path / "s", tmp_path / "up.err"
    with said.open("w") as stderr:
        up = subprocess.Popen(
            [sys.executable, "-m", "fnkernel.runtime_server.cli", "up", "--state-dir", str(state),
             "--gateway-listen", "127.0.0.1:0", "--pods", "python=1"],
            stdout=subprocess.PIPE, stderr=stderr, text=True,
        )  # fmt: skip
        try:
            printed = read_until_ready(up)
        finally:
            up.terminate()
            rest, _ = up.communicate(timeout=60)
    token = (state / "token").read_text().strip()
    shown = "\n".join(printed) + rest + said.read_text()
    assert token and token not in shown
    assert f"a new token, saved in {state / 'token'} (0600)" in shown
