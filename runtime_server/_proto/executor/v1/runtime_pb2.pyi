from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FunctionRegistrationState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FUNCTION_REGISTRATION_STATE_UNSPECIFIED: _ClassVar[FunctionRegistrationState]
    FUNCTION_REGISTRATION_STATE_REGISTERING: _ClassVar[FunctionRegistrationState]
    FUNCTION_REGISTRATION_STATE_READY: _ClassVar[FunctionRegistrationState]
    FUNCTION_REGISTRATION_STATE_DRAINING: _ClassVar[FunctionRegistrationState]
    FUNCTION_REGISTRATION_STATE_FAILED: _ClassVar[FunctionRegistrationState]
FUNCTION_REGISTRATION_STATE_UNSPECIFIED: FunctionRegistrationState
FUNCTION_REGISTRATION_STATE_REGISTERING: FunctionRegistrationState
FUNCTION_REGISTRATION_STATE_READY: FunctionRegistrationState
FUNCTION_REGISTRATION_STATE_DRAINING: FunctionRegistrationState
FUNCTION_REGISTRATION_STATE_FAILED: FunctionRegistrationState

class ExecuteRequest(_message.Message):
    __slots__ = ("run_uid", "working_dir", "handler", "env", "input", "content_type", "timeout_millis")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    RUN_UID_FIELD_NUMBER: _ClassVar[int]
    WORKING_DIR_FIELD_NUMBER: _ClassVar[int]
    HANDLER_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    CONTENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MILLIS_FIELD_NUMBER: _ClassVar[int]
    run_uid: str
    working_dir: str
    handler: str
    env: _containers.ScalarMap[str, str]
    input: bytes
    content_type: str
    timeout_millis: int
    def __init__(self, run_uid: _Optional[str] = ..., working_dir: _Optional[str] = ..., handler: _Optional[str] = ..., env: _Optional[_Mapping[str, str]] = ..., input: _Optional[bytes] = ..., content_type: _Optional[str] = ..., timeout_millis: _Optional[int] = ...) -> None: ...

class ExecuteResponse(_message.Message):
    __slots__ = ("output", "content_type", "outputs", "exit_code")
    class OutputsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    CONTENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    output: bytes
    content_type: str
    outputs: _containers.ScalarMap[str, str]
    exit_code: int
    def __init__(self, output: _Optional[bytes] = ..., content_type: _Optional[str] = ..., outputs: _Optional[_Mapping[str, str]] = ..., exit_code: _Optional[int] = ...) -> None: ...

class FunctionRegistration(_message.Message):
    __slots__ = ("run_uid", "registration_id")
    RUN_UID_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    run_uid: str
    registration_id: str
    def __init__(self, run_uid: _Optional[str] = ..., registration_id: _Optional[str] = ...) -> None: ...

class RegisterFunctionRequest(_message.Message):
    __slots__ = ("run_uid", "registration_attempt", "working_dir", "handler", "env", "idle_timeout_seconds", "registration_digest", "memory_mb")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    RUN_UID_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    WORKING_DIR_FIELD_NUMBER: _ClassVar[int]
    HANDLER_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_DIGEST_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MB_FIELD_NUMBER: _ClassVar[int]
    run_uid: str
    registration_attempt: int
    working_dir: str
    handler: str
    env: _containers.ScalarMap[str, str]
    idle_timeout_seconds: int
    registration_digest: str
    memory_mb: int
    def __init__(self, run_uid: _Optional[str] = ..., registration_attempt: _Optional[int] = ..., working_dir: _Optional[str] = ..., handler: _Optional[str] = ..., env: _Optional[_Mapping[str, str]] = ..., idle_timeout_seconds: _Optional[int] = ..., registration_digest: _Optional[str] = ..., memory_mb: _Optional[int] = ...) -> None: ...

class RegisterFunctionResponse(_message.Message):
    __slots__ = ("registration", "state")
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    registration: FunctionRegistration
    state: FunctionRegistrationState
    def __init__(self, registration: _Optional[_Union[FunctionRegistration, _Mapping]] = ..., state: _Optional[_Union[FunctionRegistrationState, str]] = ...) -> None: ...

class FunctionStatusRequest(_message.Message):
    __slots__ = ("registration",)
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    registration: FunctionRegistration
    def __init__(self, registration: _Optional[_Union[FunctionRegistration, _Mapping]] = ...) -> None: ...

class FunctionStatusResponse(_message.Message):
    __slots__ = ("registration", "state", "in_flight", "last_activity_unix_nano", "fatal_error")
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    LAST_ACTIVITY_UNIX_NANO_FIELD_NUMBER: _ClassVar[int]
    FATAL_ERROR_FIELD_NUMBER: _ClassVar[int]
    registration: FunctionRegistration
    state: FunctionRegistrationState
    in_flight: int
    last_activity_unix_nano: int
    fatal_error: str
    def __init__(self, registration: _Optional[_Union[FunctionRegistration, _Mapping]] = ..., state: _Optional[_Union[FunctionRegistrationState, str]] = ..., in_flight: _Optional[int] = ..., last_activity_unix_nano: _Optional[int] = ..., fatal_error: _Optional[str] = ...) -> None: ...

class InvokeFunctionRequest(_message.Message):
    __slots__ = ("registration", "invocation_id", "input", "content_type", "timeout_millis")
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    INVOCATION_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    CONTENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MILLIS_FIELD_NUMBER: _ClassVar[int]
    registration: FunctionRegistration
    invocation_id: str
    input: bytes
    content_type: str
    timeout_millis: int
    def __init__(self, registration: _Optional[_Union[FunctionRegistration, _Mapping]] = ..., invocation_id: _Optional[str] = ..., input: _Optional[bytes] = ..., content_type: _Optional[str] = ..., timeout_millis: _Optional[int] = ...) -> None: ...

class InvokeFunctionResponse(_message.Message):
    __slots__ = ("registration", "invocation_id", "output", "content_type", "outputs")
    class OutputsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    INVOCATION_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    CONTENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    registration: FunctionRegistration
    invocation_id: str
    output: bytes
    content_type: str
    outputs: _containers.ScalarMap[str, str]
    def __init__(self, registration: _Optional[_Union[FunctionRegistration, _Mapping]] = ..., invocation_id: _Optional[str] = ..., output: _Optional[bytes] = ..., content_type: _Optional[str] = ..., outputs: _Optional[_Mapping[str, str]] = ...) -> None: ...

class UnregisterFunctionRequest(_message.Message):
    __slots__ = ("registration", "cancel_in_flight", "drain_timeout_millis")
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    CANCEL_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_MILLIS_FIELD_NUMBER: _ClassVar[int]
    registration: FunctionRegistration
    cancel_in_flight: bool
    drain_timeout_millis: int
    def __init__(self, registration: _Optional[_Union[FunctionRegistration, _Mapping]] = ..., cancel_in_flight: _Optional[bool] = ..., drain_timeout_millis: _Optional[int] = ...) -> None: ...

class UnregisterFunctionResponse(_message.Message):
    __slots__ = ("registration",)
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    registration: FunctionRegistration
    def __init__(self, registration: _Optional[_Union[FunctionRegistration, _Mapping]] = ...) -> None: ...
