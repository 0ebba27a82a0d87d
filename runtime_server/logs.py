"""Structured logs: JSON lines with run_uid, invocation_id and stream (docs/protocol.md, "Adapters")."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

from fnkernel.system.private import create_private

_FIELDS = ("run_uid", "invocation_id", "stream")
COMPONENT_LOG_BYTES = 32 << 20  # a component's log, before it is rotated (one older one is kept)


class JsonLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in _FIELDS:
            value = getattr(record, name, None)
            if value:
                entry[name] = value
        if record.exc_info:
            entry["traceback"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure(level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLines())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def rotate(path: Path, limit: int | None = None) -> bool:
    """Keep a component's log (``fnkernel up``'s STATE_DIR/logs/NAME.log) under `limit`: once it
    is larger, its lines move to ``NAME.log.1``, replacing the older ones there, and the log
    starts empty. Copied and truncated rather than renamed: the component appends through a
    descriptor of its own (O_APPEND), which would go on writing into a renamed file. A line
    written between the copy and the truncation is lost. True if it rotated."""
    try:
        if path.stat().st_size <= (COMPONENT_LOG_BYTES if limit is None else limit):
            return False
        older = path.with_name(f"{path.name}.1")
        with path.open("rb") as log, os.fdopen(create_private(older), "wb") as kept:
            shutil.copyfileobj(log, kept)
        os.truncate(path, 0)
    except OSError:
        return False
    return True
