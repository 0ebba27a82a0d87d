from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class EvaluateFunctionRequest(_message.Message):
    __slots__ = ("resource_list", "image", "tag", "exec_path")
    RESOURCE_LIST_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    EXEC_PATH_FIELD_NUMBER: _ClassVar[int]
    resource_list: bytes
    image: str
    tag: str
    exec_path: str
    def __init__(self, resource_list: _Optional[bytes] = ..., image: _Optional[str] = ..., tag: _Optional[str] = ..., exec_path: _Optional[str] = ...) -> None: ...

class EvaluateFunctionResponse(_message.Message):
    __slots__ = ("resource_list", "log")
    RESOURCE_LIST_FIELD_NUMBER: _ClassVar[int]
    LOG_FIELD_NUMBER: _ClassVar[int]
    resource_list: bytes
    log: bytes
    def __init__(self, resource_list: _Optional[bytes] = ..., log: _Optional[bytes] = ...) -> None: ...
