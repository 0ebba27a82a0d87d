"""Cells and lookups the kernel tests share: functions defined in a cell, and where a kernel's
embedded runtime is."""

from __future__ import annotations

from tests.kernel.kernels import Kernel
from tests.support import GATE_WAIT

ETL = """%%function etl
def handler(event, context):
    context.set_output("rows", str(len(event["rows"])))
    print("processing", len(event["rows"]), "rows")
    return {"total": sum(event["rows"])}
"""
SLOW = """%%function slow
import time

def handler(event):
    time.sleep(event["s"])
    return event["s"]
"""
GREET_SH = """%%function greet --runtime bash --env GREETING=hello
handler() {
  echo "name=$1" >> "$FUNCTION_OUTPUTS"
  printf '%s, %s' "$GREETING" "$1"
}
"""
WAITS = f"""%%function waits --replicas 2
{GATE_WAIT}
def handler(event):
    print("started", event["say"])
    wait_for_gate(event["go"])
    print("finished", event["say"])
    return event["say"]
"""


def gateway_address(kernel: Kernel) -> str:
    address = kernel.value("get_ipython()._fnkernel_session.runtime.address")
    assert isinstance(address, str) and address
    return address


def registration(kernel: Kernel, name: str) -> dict[str, str]:
    status = kernel.value(f"{name}.status()")
    return {
        "uid": status["uid"],
        "registrationId": status["live"]["registrationId"],
        "phase": status["status"]["phase"],
    }
