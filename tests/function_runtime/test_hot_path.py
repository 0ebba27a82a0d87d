"""docs/architecture.md, "The hot path", and docs/protocol.md, "Adapters": how a payload's JSON
is encoded, and the memory its copies reuse, in the components and in the Python worker."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from fnkernel.runtime_server import payloads
from tests.support import Client

# Eight times, four 4 MiB blocks at once (a payload's copies), every page written, then freed;
# returns the minor page faults that took. With glibc's defaults the freed blocks go back to the
# kernel each time (16 MiB, past the trim threshold it sets itself, twice the largest block), so
# every round faults all its pages in again; kept, the first round's pages serve the rest.
FAULTS = """
import resource
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(8):
        blocks = [b"x" * (4 << 20) for _ in range(4)]
        del blocks
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
"""
PAGES = 8 * 4 * (4 << 20) // 4096


def faults_in_a_process(*setup: str) -> int:
    code = "\n".join([*setup, FAULTS, "print(faults())"])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(done.stdout)


def test_a_component_keeps_freed_memory_for_the_next_payload() -> None:
    kept = faults_in_a_process(
        "from fnkernel.runtime_server import daemon", "assert daemon.keep_freed_memory()"
    )
    default = faults_in_a_process()
    assert default > PAGES // 2  # the measure sees fresh pages when they are fresh
    assert kept < PAGES // 4


def test_the_python_worker_keeps_freed_memory_before_the_handler_runs(python_rt: Client) -> None:
    source = FAULTS + "\ndef handle(event):\n    return faults()\n"
    reg = python_rt.register({"handler.py": source})
    assert int(python_rt.invoke(reg.registration, b"null").output) < PAGES // 4


RESULTS = {
    "handler.py": """
        import datetime, math

        def handle(event):
            if event == "past orjson":
                return {"big": 2 ** 70, 1: "an int key"}
            return {"when": datetime.date(2026, 12, 2), "nan": math.nan, "text": "é ☃"}
    """
}


def test_a_python_result_is_compact_json_from_either_library(python_rt: Client) -> None:
    reg = python_rt.register({name: textwrap.dedent(text) for name, text in RESULTS.items()})
    # What orjson refuses, the standard library encodes, as compactly.
    output = python_rt.invoke(reg.registration, b'"past orjson"').output
    assert output == b'{"big":1180591620717411303424,"1":"an int key"}'
    # What only orjson encodes; NaN, which JSON cannot hold, is null; UTF-8 as it is.
    output = python_rt.invoke(reg.registration, b'"orjson"').output
    assert output == '{"when":"2026-12-02","nan":null,"text":"é ☃"}'.encode()


@pytest.mark.parametrize(
    ("value", "encoded"),
    [
        ({"a": [1, 2.5, None, True]}, b'{"a":[1,2.5,null,true]}'),
        ({"big": -(2**70)}, b'{"big":-1180591620717411303424}'),  # the standard library's
        ({2: "x"}, b'{"2":"x"}'),  # the standard library's
        ("\ud800 lone", b'"\\ud800 lone"'),  # the standard library's, escaped
        ([[[[]]]] * 2, b"[[[[]]],[[[]]]]"),
        (float("inf"), b"null"),
    ],
)
def test_a_payload_encodes_if_either_library_can(value: object, encoded: bytes) -> None:
    assert payloads.dumps(value) == encoded


def test_a_payload_neither_library_encodes_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        payloads.dumps({"a": object()})
    with pytest.raises(TypeError):
        payloads.dumps({(1, 2): "a tuple key"})
