"""Large payloads from the kernel (docs/protocol.md, "Large payloads"): a DataFrame written to the
stack's spool without a copy in the kernel, and the embedded runtime's bound, set by its
variable and named when passed. Real kernels through jupyter_client."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.kernel.kernels import Kernel

pytestmark = pytest.mark.usefixtures("fnkernel_spec")

ROWS = """%%function rows
def handler(frame):
    return len(frame)
"""
MEMORY = """import numpy as np, pandas as pd

def status_bytes(field):
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) << 10

big = pd.DataFrame({"x": np.arange(16 << 20, dtype="int64")})  # 128 MiB
"""


def test_a_large_dataframe_reaches_the_spool_without_a_copy_in_the_kernel(kernel: Kernel) -> None:
    # docs/protocol.md, "Large payloads": the kernel writes an Arrow payload once, straight from
    # the DataFrame to the spool's file, never whole in its own memory first.
    assert kernel.run(ROWS).ok
    assert kernel.run(MEMORY).ok
    reset = "open('/proc/self/clear_refs', 'w').write('5'); before = status_bytes('VmRSS')"
    assert kernel.run(reset).ok  # the kernel's peak (VmHWM) is its size now
    assert kernel.value("rows(big)") == 16 << 20
    grew = kernel.value("status_bytes('VmHWM') - before")
    assert grew < 32 << 20, f"{grew >> 20} MiB above the kernel's size for a 128 MiB frame"


def test_the_embedded_runtimes_payload_bound_is_set_by_its_variable_and_named_when_passed() -> None:
    # docs/protocol.md, "Large payloads": the bound is configurable on every path; for a
    # kernel's own runtime by FNKERNEL_MAX_PAYLOAD_BYTES, and a payload past it is a 413 that
    # names it, refused before it is written to the spool.
    kernel = Kernel(env={"FNKERNEL_MAX_PAYLOAD_BYTES": str(1 << 20)})
    try:
        assert kernel.run(ROWS).ok
        assert kernel.run("import numpy as np\nfits = np.zeros(100_000)").ok
        assert kernel.value("rows(fits)") == 100_000  # 800 KB, spooled
        cell = kernel.run("rows(np.zeros(200_000))")  # 1.6 MB
        assert cell.error is not None
        [line] = cell.error["traceback"]
        assert line.startswith("PayloadTooLarge: the payload of rows is "), line
        assert line.endswith(
            f"; at most {1 << 20} (FNKERNEL_MAX_PAYLOAD_BYTES, read as this kernel starts its "
            "runtime: set it, then restart the kernel) (PAYLOAD_TOO_LARGE)"
        ), line  # the one knob that sets it here, not the gateway's flag too
        spool = kernel.value("str(get_ipython()._fnkernel_session.runtime._stack.spool)")
        assert [p.name for p in Path(spool).iterdir() if p.name.startswith("in-")] == []
        # A result past it says the same knob, from the handler's failure.
        assert kernel.run("%%function big\ndef handler(n):\n    return b'x' * n\n").ok
        cell = kernel.run("big(2 << 20)")
        assert cell.error is not None
        line = cell.error["traceback"][-1]
        assert line.startswith("OutputTooLarge: the handler returned 2097152 bytes"), line
        assert "FNKERNEL_MAX_PAYLOAD_BYTES for the kernel's own runtime" in line, line
    finally:
        kernel.shutdown()


def test_an_embedded_runtimes_bound_that_is_no_number_is_one_line() -> None:
    # README: errors of the platform are one line. A variable that is not a number of bytes
    # starts nothing, and says which and what it takes.
    kernel = Kernel(env={"FNKERNEL_MAX_PAYLOAD_BYTES": "2GiB"})
    try:
        cell = kernel.run(ROWS)
        assert cell.error is not None
        [line] = cell.error["traceback"]
        assert line.startswith("StackMisconfigured: FNKERNEL_MAX_PAYLOAD_BYTES: must be an"), line
        assert "got '2GiB'" in line and "the embedded runtime was not started" in line, line
    finally:
        kernel.shutdown()
