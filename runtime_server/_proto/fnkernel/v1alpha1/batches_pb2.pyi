from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InvokeBatchRequest(_message.Message):
    __slots__ = ("run_uid", "registration_id", "items", "timeout_millis", "go_on", "refill_at", "last")
    RUN_UID_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MILLIS_FIELD_NUMBER: _ClassVar[int]
    GO_ON_FIELD_NUMBER: _ClassVar[int]
    REFILL_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    run_uid: str
    registration_id: str
    items: _containers.RepeatedCompositeFieldContainer[BatchItem]
    timeout_millis: int
    go_on: bool
    refill_at: int
    last: bool
    def __init__(self, run_uid: _Optional[str] = ..., registration_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[BatchItem, _Mapping]]] = ..., timeout_millis: _Optional[int] = ..., go_on: _Optional[bool] = ..., refill_at: _Optional[int] = ..., last: _Optional[bool] = ...) -> None: ...

class BatchItem(_message.Message):
    __slots__ = ("invocation_id", "input", "content_type")
    INVOCATION_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    CONTENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    invocation_id: str
    input: bytes
    content_type: str
    def __init__(self, invocation_id: _Optional[str] = ..., input: _Optional[bytes] = ..., content_type: _Optional[str] = ...) -> None: ...

class BatchAnswers(_message.Message):
    __slots__ = ("answers",)
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    answers: _containers.RepeatedCompositeFieldContainer[BatchAnswer]
    def __init__(self, answers: _Optional[_Iterable[_Union[BatchAnswer, _Mapping]]] = ...) -> None: ...

class BatchAnswer(_message.Message):
    __slots__ = ("index", "invocation_id", "output", "content_type", "outputs", "code", "message", "trailers")
    class OutputsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class TrailersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    INDEX_FIELD_NUMBER: _ClassVar[int]
    INVOCATION_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    CONTENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TRAILERS_FIELD_NUMBER: _ClassVar[int]
    index: int
    invocation_id: str
    output: bytes
    content_type: str
    outputs: _containers.ScalarMap[str, str]
    code: int
    message: str
    trailers: _containers.ScalarMap[str, bytes]
    def __init__(self, index: _Optional[int] = ..., invocation_id: _Optional[str] = ..., output: _Optional[bytes] = ..., content_type: _Optional[str] = ..., outputs: _Optional[_Mapping[str, str]] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., trailers: _Optional[_Mapping[str, bytes]] = ...) -> None: ...
