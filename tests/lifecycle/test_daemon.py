"""docs/architecture.md, "Command lines": every process that starts a component builds its argv
with runtime_server.daemon, and each of those command lines is one the CLI itself accepts."""

from __future__ import annotations

from pathlib import Path

import pytest

from fnkernel.runtime_server import daemon
from fnkernel.runtime_server.cli import build_parser


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            daemon.serve_args("bash", "unix:/s/bash-0.sock", Path("/w"), "--oneshot-only"),
            {"runtime": "bash", "listen": "unix:/s/bash-0.sock", "workspace_root": "/w",
             "oneshot_only": True},
        ),
        (
            daemon.runtimed_args("python-0", "python", "unix:/s/p.sock", "unix:/s/r.sock", 0.2,
                                 Path("/st"), Path("/w/python-0")),
            {"pod": "python-0", "runtime": "python", "server": "unix:/s/p.sock",
             "listen": "unix:/s/r.sock", "poll_interval": 0.2, "state_dir": "/st",
             "workspace": "/w/python-0"},
        ),
        (
            daemon.gateway_args("127.0.0.1:0", Path("/st"), token_file=Path("/st/token"),
                                allow_origins=["https://a.example"], allow_hosts=["fn.local"]),
            {"listen": "127.0.0.1:0", "state_dir": "/st", "token_file": "/st/token",
             "no_token": False, "allow_origin": ["https://a.example"], "allow_host": ["fn.local"]},
        ),
        (
            daemon.gateway_args("127.0.0.1:0", Path("/st"), no_token=True),
            {"no_token": True, "token_file": None},
        ),
        (
            daemon.wrapper_server_args(["/fn/bin", "--flag"]),
            {"port": 0, "entrypoint": ["--", "/fn/bin", "--flag"]},
        ),
    ],
)  # fmt: skip
def test_each_component_command_line_is_one_the_cli_accepts(
    argv: list[str], expected: dict[str, object]
) -> None:
    parsed = vars(build_parser().parse_args(argv))
    assert parsed["command"] == argv[0]
    for key, value in expected.items():
        assert parsed[key] == value, key
