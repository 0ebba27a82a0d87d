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
import json
import math
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
}


def _default(value: Any) -> Any:
    """What orjson and the standard library do not take themselves, made JSON."""
    if isinstance(value, (datetime.date, datetime.time)):  # pandas' Timestamp is a datetime
        return None if value != value else value.isoformat()  # NaT is not equal to itself
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):
        # A scalar orjson has no type for, or (standard library) an array; a longdouble is
        # its own tolist(): as a float.
        plain = value.tolist()
        return float(value) if type(plain) is type(value) else plain
    raise TypeError(f"{type(value).__name__} is not JSON")


# Strict: a NaN or an infinity is a ValueError, not the NaN literal JSON has none of; ``dumps``
# then writes null for it, as orjson does.
_ENCODER = json.JSONEncoder(separators=(",", ":"), default=_default, allow_nan=False)


def _finite(value: Any) -> Any:
    """`value` with each NaN and infinity inside it made None (numpy's made Python values
    first), for the standard library to write as null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):
        return _finite(_default(value))
    return value


def dumps(value: Any, root: str = "value") -> bytes:
    """`value` as compact JSON in UTF-8. TypeError naming the first part JSON cannot hold,
    as a path from `root` (``payload``, ``result``); ValueError for a circular reference."""
    if orjson is not None:
        try:
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
            return _ENCODER.encode(_finite(value)).encode()
    except TypeError:
        where = unencodable(value, root)
        if where is None:
            raise
        raise TypeError(where) from None


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
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                return f"{path}: a key of type {type(key).__name__} (keys must be strings)"
            found = unencodable(item, f"{path}[{json.dumps(key)}]", depth + 1)
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
        return f"{path}: {name} (convert it: {_HINTS.get(name, 'a str, number, list or dict')})"
    except ValueError:
        return None
    return None
