from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class StreamedCall(_message.Message):
    __slots__ = ("request", "metadata", "timeout_micros")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MICROS_FIELD_NUMBER: _ClassVar[int]
    request: bytes
    metadata: _containers.ScalarMap[str, bytes]
    timeout_micros: int
    def __init__(self, request: _Optional[bytes] = ..., metadata: _Optional[_Mapping[str, bytes]] = ..., timeout_micros: _Optional[int] = ...) -> None: ...

class StreamedAnswer(_message.Message):
    __slots__ = ("response", "code", "message", "trailers")
    class TrailersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TRAILERS_FIELD_NUMBER: _ClassVar[int]
    response: bytes
    code: int
    message: str
    trailers: _containers.ScalarMap[str, bytes]
    def __init__(self, response: _Optional[bytes] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., trailers: _Optional[_Mapping[str, bytes]] = ...) -> None: ...
