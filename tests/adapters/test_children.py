"""Starting a handler's process held to its memory (adapters/children.py: spawn_limited;
docs/protocol.md, "Limits": memory_mb is RLIMIT_DATA of the worker and whatever it starts)."""

from __future__ import annotations

import re
import resource
import subprocess
import sys
from pathlib import Path

from fnkernel.adapters.children import spawn_limited


def _data_limit(pid: int) -> tuple[str, str]:
    text = Path(f"/proc/{pid}/limits").read_text()
    found = re.search(r"^Max data size\s+(\S+)\s+(\S+)", text, re.MULTILINE)
    assert found is not None, text
    return found.group(1), found.group(2)


def test_the_process_and_what_it_starts_later_are_held_to_the_bound() -> None:
    bound = 256 << 20
    # the child starts a grandchild once told to (a line on stdin), after the bound is set
    script = (
        "import subprocess, sys; sys.stdin.readline(); subprocess.run(['cat', '/proc/self/limits'])"
    )
    proc = spawn_limited(
        [sys.executable, "-c", script], bound, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert _data_limit(proc.pid) == (str(bound), str(bound))
        out, _ = proc.communicate(b"go\n", timeout=30)
    finally:
        proc.kill()
        proc.wait(10)
    line = next(row for row in out.decode().splitlines() if row.startswith("Max data size"))
    assert line.split()[3:5] == [str(bound), str(bound)]


def test_no_bound_leaves_the_limit_as_it_was() -> None:
    ours = resource.getrlimit(resource.RLIMIT_DATA)
    proc = spawn_limited(["sleep", "30"], 0)
    try:
        shown = _data_limit(proc.pid)
    finally:
        proc.kill()
        proc.wait(10)
    as_text = tuple("unlimited" if v == resource.RLIM_INFINITY else str(v) for v in ours)
    assert shown == as_text
