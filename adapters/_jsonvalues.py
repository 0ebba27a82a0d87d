"""A payload or a result as JSON, the one way fnkernel writes and reads them (docs/protocol.md,
"JSON encodings"): by the kernel and the client for a payload, by the Python worker for a result.

orjson encodes, 15 to 100 times as fast as the standard library (docs/architecture.md, "A
payload's bytes"); where it refuses (integers past 64 bits, keys that are not strings, a lone
surrogate, nesting past 254 levels) the standard library does. Both write what plain pandas and
numpy code returns: numpy scalars as their Python values and numpy arrays as lists, datetimes
(pandas' ``Timestamp`` too) as ISO 8601 strings, a missing time (``NaT``) as null, NaN as null.
A value JSON cannot hold (``Decimal``, ``set``, ``bytes``, ...) is a TypeError naming its path
inside the value: ``result["stats"][3]: Decimal``, with how to convert it.

Reading (``loads``) is the standard library's but for a text of FAST_LOADS_FROM bytes or more:
msgspec reads that, twice as fast, integers past 64 bits as exactly as the standard library
(orjson reads them as floats, losing digits), and what it refuses the standard library reads.

Standard library, orjson and msgspec only: the worker loads this file by its path, before the
handler's directory is on ``sys.path``, and imports nothing else of fnkernel.
"""

from __future__ import annotations

import datetime
import enum
import itertools
import json
import math
import resource
import sys
from typing import Any

try:
    import orjson
except ImportError:  # a dependency: only a broken install gets here, and it is slower
    orjson = None  # type: ignore[assignment]

_OPTIONS = orjson.OPT_SERIALIZE_NUMPY if orjson is not None else 0
# From this size a text is read by msgspec (docs/architecture.md, "A payload's bytes"): below
# it the two differ by microseconds, and msgspec's import (~15 ms) is not worth them.
FAST_LOADS_FROM = 64 << 10
_fast_loads: Any = None  # msgspec's decode, once a text was that large
# How to make a value JSON can hold, by its type's name (the error says it).
_HINTS = {
    "Decimal": "float(x) or str(x)",
    "set": "sorted(x) or list(x)",
    "frozenset": "sorted(x) or list(x)",
    "bytes": "x.decode() for text, base64 for binary",
    "bytearray": "x.decode() for text, base64 for binary",
    "timedelta": "x.total_seconds()",
    "Timedelta": "x.total_seconds()",
    "DataFrame": "df.to_dict('records')",
    "Series": "s.tolist() or s.to_dict()",
    "LazyFrame": "x.collect(): a polars.DataFrame, sent on its own as Arrow",
    "MaskedArray": "x.filled(value) or x.tolist(), its masked values None",
}


def _hint(kind: type) -> str:
    """How to make a value of `kind` one JSON holds (the error says it)."""
    if kind.__name__ in _HINTS:
        return _HINTS[kind.__name__]
    if kind.__module__.startswith("pyarrow") and kind.__name__.endswith("Array"):
        return "x.to_pylist(), or send pyarrow.table({'name': x}) on its own, as Arrow"
    return "a str, number, list or dict"


def _default(value: Any) -> Any:
    """What orjson and the standard library do not take themselves, made JSON."""
    if isinstance(value, (datetime.date, datetime.time)):  # pandas' Timestamp is a datetime
        return None if value != value else value.isoformat()  # NaT is not equal to itself
    kind = type(value)
    if kind.__module__ == "numpy" and hasattr(value, "tolist"):
        # A scalar orjson has no type for, or (standard library) an array; a longdouble is
        # its own tolist(): as a float.
        plain = value.tolist()
        return float(value) if type(plain) is type(value) else plain
    if kind.__module__.startswith("pandas"):
        if kind.__name__ == "NAType":  # pd.NA, a nullable column's missing value
            return None
        if any(base.__name__ == "ExtensionArray" for base in kind.__mro__):
            return value.tolist()  # `.unique()` of an Arrow-backed or nullable column, say
    # What orjson writes itself, for the standard library (a value orjson refused elsewhere);
    # a UUID or a dataclass means its module is loaded (not imported here: a worker's start).
    uuids = sys.modules.get("uuid")
    if uuids is not None and isinstance(value, uuids.UUID):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.value
    if hasattr(kind, "__dataclass_fields__"):
        fields = sys.modules["dataclasses"].fields(value)
        return {field.name: getattr(value, field.name) for field in fields}
    raise TypeError(f"{type(value).__name__} is not JSON")


# Strict: a NaN or an infinity is a ValueError, not the NaN literal JSON has none of; ``dumps``
# then writes null for it, as orjson does.
_ENCODER = json.JSONEncoder(separators=(",", ":"), default=_default, allow_nan=False)


def _plain(value: Any) -> Any:
    """`value` as the standard library writes what orjson would: each NaN and infinity inside
    it None (numpy's made Python values first), a numpy scalar key its Python value (an
    integer key is written as its digits)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {_plain_key(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):
        return _plain(_default(value))
    return value


def _plain_key(key: Any) -> Any:
    return key.item() if type(key).__module__ == "numpy" and hasattr(key, "item") else key


def dumps(value: Any, root: str = "value") -> bytes:
    """`value` as compact JSON in UTF-8. TypeError naming the first part JSON cannot hold,
    as a path from `root` (``payload``, ``result``); ValueError for a circular reference."""
    if orjson is not None:
        try:
            if memory_limited() and _large(value):
                pieces: list[bytes] = []
                _write(value, pieces, 0)
                _room(sum(map(len, pieces)))
                return b"".join(pieces)
            return orjson.dumps(value, default=_default, option=_OPTIONS)
        except orjson.JSONEncodeError:
            pass
    try:
        # ASCII: a lone surrogate (which orjson refuses too) is written as its \u escape.
        try:
            return _ENCODER.encode(value).encode()
        except ValueError as exc:
            if "Out of range float" not in str(exc):
                raise  # a circular reference
        except TypeError:  # a key of numpy's, say: as plain values, else named below
            pass
        return _ENCODER.encode(_plain(value)).encode()
    except TypeError:
        where = unencodable(value, root)
        if where is None:
            raise
        raise TypeError(where) from None


# orjson reserves room for a list or dict as it begins to write it — a few hundred bytes an
# item — and eight bytes a character for a string: address space many times the text's size
# (a 3 MiB text of 500,000 numbers took 128 MiB). Held to a memory limit (RLIMIT_DATA: a
# handler's worker), it fails to grow its buffer long before the memory is used, and crashes
# the process rather than raise MemoryError. There a large value is written here a slice at
# a time, each slice by orjson, into the same text (docs/architecture.md, "A payload's bytes").
PIECE_ITEMS = 4096
PIECE_CHARACTERS = 1 << 20
_LOOKED_AT = 16  # the parts of a value looked at for a large one inside


def _large(value: Any) -> bool:
    """Whether `value` is a list, tuple, dict or string longer than a piece, or holds one among
    the first _LOOKED_AT parts of it looked at (depth first, a dict's values)."""
    if not isinstance(value, (str, list, tuple, dict)):
        return False
    parts, looked = [value], 0
    while parts and looked < _LOOKED_AT:
        part = parts.pop()
        looked += 1
        if isinstance(part, str):
            if len(part) > PIECE_CHARACTERS:
                return True
        elif isinstance(part, (list, tuple, dict)):
            if len(part) > PIECE_ITEMS:
                return True
            inside = part.values() if isinstance(part, dict) else part
            parts.extend(itertools.islice(inside, _LOOKED_AT - looked))
    return False


_limited: list[bool] = []  # memory_limited's answer, once asked


def memory_limited() -> bool:
    """Whether this process is held to a memory limit (RLIMIT_DATA), as a handler's worker is:
    asked once (a syscall), as a worker's limit is set as it starts, before its first call."""
    if not _limited:
        _limited.append(resource.getrlimit(resource.RLIMIT_DATA)[0] != resource.RLIM_INFINITY)
    return _limited[0]


# What orjson may reserve for one piece: ~512 bytes an item of a dict, 8 a character.
_PIECE_ROOM = max(512 * PIECE_ITEMS, 8 * PIECE_CHARACTERS) + (1 << 20)


def _room(needed: int) -> None:
    """MemoryError, as Python's own allocations raise it, unless the memory limit leaves this
    process `needed` bytes more: what orjson cannot say itself."""
    limit = resource.getrlimit(resource.RLIMIT_DATA)[0]
    with open("/proc/self/statm", "rb") as statm:  # its sixth field: data (and stack) pages
        used = int(statm.read().split()[5]) * resource.getpagesize()
    if limit != resource.RLIM_INFINITY and used + needed > limit:
        raise MemoryError(f"{needed} bytes more would pass the memory limit of {limit} bytes")


def _write(value: Any, pieces: list[bytes], depth: int) -> None:
    """`value` as orjson writes it, appended to `pieces`: a large one (``_large``) a slice of
    its items or characters at a time; orjson.JSONEncodeError where orjson refuses a part."""
    if depth > 32 or not _large(value):  # deeper: orjson says if it nests too deep
        _room(_PIECE_ROOM)
        pieces.append(orjson.dumps(value, default=_default, option=_OPTIONS))
        return
    if isinstance(value, str):  # its slices' characters follow one another
        brackets, comma = b'""', b""
        slices: Any = (
            value[start : start + PIECE_CHARACTERS]
            for start in range(0, len(value), PIECE_CHARACTERS)
        )
    elif isinstance(value, dict):
        brackets, comma, pairs = b"{}", b",", iter(value.items())
        slices = iter(lambda: dict(itertools.islice(pairs, PIECE_ITEMS)), {})
    else:
        brackets, comma = b"[]", b","
        slices = (value[start : start + PIECE_ITEMS] for start in range(0, len(value), PIECE_ITEMS))
    pieces.append(brackets[:1])
    for index, piece in enumerate(slices):
        if index:
            pieces.append(comma)
        _write_slice(piece, pieces, depth)
    pieces.append(brackets[1:])


def _write_slice(piece: Any, pieces: list[bytes], depth: int) -> None:
    """A slice of a large string, list or dict, written without its quotes or brackets: by
    orjson whole, or — holding a large part — a part at a time."""
    _room(_PIECE_ROOM)
    if isinstance(piece, str) or not _large(piece):
        pieces.append(orjson.dumps(piece, default=_default, option=_OPTIONS)[1:-1])
        return
    keyed = isinstance(piece, dict)
    for index, (key, item) in enumerate(piece.items() if keyed else enumerate(piece)):
        if keyed and not isinstance(key, str):  # as orjson refuses it
            raise orjson.JSONEncodeError("Dict key must be str")
        pieces.append((b"," if index else b"") + (orjson.dumps(key) + b":" if keyed else b""))
        _write(item, pieces, depth + 1)


def loads(data: bytes) -> Any:
    """The JSON text `data` as Python values, exactly as the standard library reads it, or its
    ValueError (nesting too deep for Python's recursion too): from FAST_LOADS_FROM bytes by
    msgspec, unless it refuses what the standard library takes (NaN and Infinity, a number
    past a float's range, a lone surrogate, a byte order mark, nesting past its depth) or what
    is not JSON at all."""
    global _fast_loads
    if len(data) >= FAST_LOADS_FROM:
        if _fast_loads is None:
            try:
                import msgspec.json
            except ImportError:  # a dependency: only a broken install gets here
                _fast_loads = False
            else:
                _fast_loads = msgspec.json.Decoder().decode
        if _fast_loads:
            try:
                return _fast_loads(data)
            except (ValueError, RecursionError):  # msgspec.DecodeError is a ValueError
                pass
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("nested deeper than Python's recursion limit") from None


def unencodable(value: Any, path: str = "value", depth: int = 0) -> str | None:
    """The first part of `value` that JSON cannot hold, as ``PATH: TYPE (convert: HINT)``;
    None if there is none (or it lies past a depth no JSON value reaches)."""
    if depth > 1000:
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(_plain_key(key), (str, int, float, bool)) and key is not None:
                return f"{path}: a key of type {type(key).__name__} (keys must be strings)"
            found = unencodable(item, f"{path}[{json.dumps(_plain_key(key))}]", depth + 1)
            if found is not None:
                return found
        return None
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            found = unencodable(item, f"{path}[{index}]", depth + 1)
            if found is not None:
                return found
        return None
    try:
        _ENCODER.encode(value)
    except TypeError:
        name = type(value).__name__
        return f"{path}: {name} (convert it: {_hint(type(value))})"
    except ValueError:
        return None
    return None
