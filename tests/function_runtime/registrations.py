"""Handlers the registration tests share: functions that sleep or finish late."""

from __future__ import annotations

from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb

READY = pb.FUNCTION_REGISTRATION_STATE_READY
FAILED = pb.FUNCTION_REGISTRATION_STATE_FAILED
SLOW = {
    "handler.py": """
        import os, time
        from pathlib import Path

        def handle(event, context):
            Path("pid").write_text(str(os.getpid()))
            time.sleep(event.get("sleep", 0))
            return {"slept": event.get("sleep", 0)}
    """
}

FINISHES_LATE = {
    # A call that leaves a trace if it is allowed to finish: `finished`, after `event` seconds.
    "handler.py": """
        import os, time
        from pathlib import Path

        def handle(event):
            Path("pid").write_text(str(os.getpid()))
            time.sleep(event)
            Path("finished").touch()
    """
}
