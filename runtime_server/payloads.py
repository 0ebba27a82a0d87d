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
    expire_free_files,
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
    "Outgoing",
    "PayloadError",
    "arrow_table",
    "decode",
    "decode_file",
    "dumps",
    "encode",
    "encode_to_file",
    "expire_free_files",
    "items_of",
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


# How a table's parts or rows are had, by its kind: what a map over it should have been given.
_PARTS = {
    "pandas.DataFrame": "[frame.iloc[i:i + rows] for i in range(0, len(frame), rows)] or "
    "frame.to_dict('records')",
    "polars.DataFrame": "list(frame.iter_slices(rows)) or frame.to_dicts()",
    "pyarrow.Table": "table.to_batches(rows) or table.to_pylist()",
    "pyarrow.RecordBatch": "[batch.slice(i, rows) for i in range(0, batch.num_rows, rows)]",
}


def items_of(items: Any) -> list[Any]:
    """The items of a map, one call each; TypeError for a table (a DataFrame iterates its
    column labels, not its parts), saying how to give its parts or rows instead."""
    kind = kind_of(items)
    if kind in _PARTS:
        raise TypeError(
            f"map takes its items, a call each, and a {kind} is one item: map over its parts "
            f"or rows ({_PARTS[kind]})"
        )
    grouped = type(items)
    if grouped.__module__.startswith("pandas") and grouped.__name__.endswith("GroupBy"):
        # Its items would be (key, part) pairs, which JSON cannot hold (a frame inside).
        raise TypeError(
            f"map takes its items, a call each, and a pandas {grouped.__name__} gives (key, "
            "part) pairs: map over its parts ([part for _, part in grouped])"
        )
    return list(items)


class Outgoing:
    """A value made ready to send (``Outgoing.of``): its bytes and their content type, or, of
    an Arrow kind, its Arrow table, which the sender writes straight to where its size says (the
    stack's spool, or the request) and never holds whole as bytes. ``Client.invoke`` takes one
    as its payload, so that a caller learns that a value cannot be sent before it calls."""

    __slots__ = ("encoded", "table")

    def __init__(self, encoded: tuple[bytes, str] | None, table: Any = None) -> None:
        self.encoded = encoded
        self.table = table

    @classmethod
    def of(cls, value: Any, root: str = "payload") -> Outgoing:
        """`value` ready to send: TypeError naming the part JSON cannot hold (a path from
        `root`); NotArrow, PayloadError as ``arrow_table``."""
        table = arrow_table(value, root)
        return cls(None, table) if table is not None else cls(encode(value, root))

    @property
    def size(self) -> int:
        """About the bytes it will be: an Arrow table's are about its ``nbytes``."""
        return len(self.encoded[0]) if self.encoded is not None else int(self.table.nbytes)
