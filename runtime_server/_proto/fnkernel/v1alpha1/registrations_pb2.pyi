from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as _runtime_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StopLoadingRequest(_message.Message):
    __slots__ = ("run_uid", "registration_attempt")
    RUN_UID_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    run_uid: str
    registration_attempt: int
    def __init__(self, run_uid: _Optional[str] = ..., registration_attempt: _Optional[int] = ...) -> None: ...

class StopLoadingResponse(_message.Message):
    __slots__ = ("stopped",)
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    stopped: bool
    def __init__(self, stopped: _Optional[bool] = ...) -> None: ...

class FunctionStatusesRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[_runtime_pb2.FunctionStatusRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[_runtime_pb2.FunctionStatusRequest, _Mapping]]] = ...) -> None: ...

class FunctionStatusesResponse(_message.Message):
    __slots__ = ("answers",)
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    answers: _containers.RepeatedCompositeFieldContainer[FunctionStatusAnswer]
    def __init__(self, answers: _Optional[_Iterable[_Union[FunctionStatusAnswer, _Mapping]]] = ...) -> None: ...

class FunctionStatusAnswer(_message.Message):
    __slots__ = ("status", "code", "message")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    status: _runtime_pb2.FunctionStatusResponse
    code: int
    message: str
    def __init__(self, status: _Optional[_Union[_runtime_pb2.FunctionStatusResponse, _Mapping]] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...
