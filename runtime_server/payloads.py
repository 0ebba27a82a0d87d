"""A payload's and a result's bytes where they pass: their content type (docs/protocol.md,
"Content types": JSON, Arrow IPC for DataFrames, tables and arrays, octets for bytes) and their
JSON encoding (docs/architecture.md, "A payload's bytes"; docs/protocol.md, "JSON encodings").
The codec is the Python worker's own (``adapters/_payloads.py``), so what the kernel sends and
what a handler returns are written and read alike.

The JSON encoder is the Python worker's own (``adapters/_jsonvalues.py``), so a payload the kernel
sends and a result a handler returns are written alike: by orjson, 15 to 100 times as fast as
the standard library (a 1 MiB string: 0.07 ms against 7.4 ms here), and by the standard library
where orjson refuses — integers past 64 bits, keys that are not strings (``{"1": ...}`` for
``{1: ...}``), a string with a lone surrogate, nesting past 254 levels. What differs from the
standard library: the text is compact (``{"a":1}``); NaN and ±Infinity are ``null``; numpy
scalars and arrays, datetimes (pandas' too), dataclasses, UUIDs and enums are encoded; a value
JSON cannot hold is a TypeError naming its path.

Decoding is the standard library's, and msgspec's for a text of 64 KiB or more (as exact, twice
as fast): orjson reads an integer past 64 bits as a float, losing digits, and looking for one
first costs what orjson saves.
"""

from __future__ import annotations

from typing import Any

from fnkernel.adapters import _jsonvalues
from fnkernel.adapters._payloads import (
    ARROW,
    FREE_PREFIX,
    JSON,
    MEDIA_TYPES,
    OCTET,
    NotArrow,
    PayloadError,
    arrow_table,
    decode,
    decode_file,
    encode,
    encode_to_file,
    kind_of,
    media_type,
    release,
    spool_file,
    table_bytes,
    write_table,
)

__all__ = [
    "ARROW",
    "FREE_PREFIX",
    "JSON",
    "MEDIA_TYPES",
    "OCTET",
    "NotArrow",
    "PayloadError",
    "arrow_table",
    "decode",
    "decode_file",
    "dumps",
    "encode",
    "encode_to_file",
    "kind_of",
    "media_type",
    "release",
    "spool_file",
    "table_bytes",
    "write_table",
]


def dumps(value: Any, root: str = "payload") -> bytes:
    """`value` as JSON text in UTF-8; TypeError naming the part (a path from `root`) that JSON
    cannot hold, ValueError for a circular reference."""
    return _jsonvalues.dumps(value, root)
