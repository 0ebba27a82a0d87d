from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class FollowInvocationLogsRequest(_message.Message):
    __slots__ = ("run_uid", "registration_id", "invocation_id", "follow")
    RUN_UID_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    INVOCATION_ID_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    run_uid: str
    registration_id: str
    invocation_id: str
    follow: bool
    def __init__(self, run_uid: _Optional[str] = ..., registration_id: _Optional[str] = ..., invocation_id: _Optional[str] = ..., follow: _Optional[bool] = ...) -> None: ...

class InvocationLogRecord(_message.Message):
    __slots__ = ("invocation_id", "stream", "text", "cut", "running")
    INVOCATION_ID_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CUT_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    invocation_id: str
    stream: str
    text: str
    cut: bool
    running: bool
    def __init__(self, invocation_id: _Optional[str] = ..., stream: _Optional[str] = ..., text: _Optional[str] = ..., cut: _Optional[bool] = ..., running: _Optional[bool] = ...) -> None: ...
