"""A grpcurl stand-in for tests: calls a method knowing only its name, through server reflection.

It holds no .proto file and no generated stub: it asks the server's reflection service (v1 or
v1alpha) for the file descriptors, builds the messages from them, and speaks protobuf JSON, as
``grpcurl -plaintext -d '{...}' ADDR service/Method`` does.
"""

from __future__ import annotations

import json
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha import reflection_pb2

REFLECTION = {
    "v1": "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    "v1alpha": "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
}


class ReflectionClient:
    def __init__(self, channel: grpc.Channel, version: str = "v1") -> None:
        self.channel = channel
        self._stream = channel.stream_stream(
            REFLECTION[version],
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        self.pool = descriptor_pool.DescriptorPool()

    def _ask(self, **request: Any) -> reflection_pb2.ServerReflectionResponse:
        (response,) = list(
            self._stream(iter([reflection_pb2.ServerReflectionRequest(**request)]), timeout=10)
        )
        return response

    def list_services(self) -> list[str]:
        return [s.name for s in self._ask(list_services="").list_services_response.service]

    def _load(self, symbol: str) -> None:
        response = self._ask(file_containing_symbol=symbol)
        if response.HasField("error_response"):
            raise LookupError(response.error_response.error_message)
        files = [
            descriptor_pb2.FileDescriptorProto.FromString(raw)
            for raw in response.file_descriptor_response.file_descriptor_proto
        ]
        pending = {f.name: f for f in files}
        while pending:  # add dependencies before dependants
            for name, proto in list(pending.items()):
                if all(dep not in pending for dep in proto.dependency):
                    try:
                        self.pool.FindFileByName(name)
                    except KeyError:
                        self.pool.Add(proto)
                    del pending[name]

    def call(
        self, method: str, body: str, timeout: float = 30
    ) -> tuple[grpc.StatusCode, str, dict[str, Any] | None]:
        """`method` is ``package.Service/Method``; returns (code, details, response as JSON dict)."""
        service_name, _, method_name = method.partition("/")
        self._load(service_name)
        service = self.pool.FindServiceByName(service_name)
        descriptor = service.methods_by_name[method_name]
        request_cls = message_factory.GetMessageClass(descriptor.input_type)
        response_cls = message_factory.GetMessageClass(descriptor.output_type)
        request = json_format.Parse(body, request_cls())
        stub = self.channel.unary_unary(
            f"/{service_name}/{method_name}",
            request_serializer=request_cls.SerializeToString,
            response_deserializer=response_cls.FromString,
        )
        try:
            response = stub(request, timeout=timeout)
        except grpc.RpcError as err:
            return err.code(), err.details(), None
        return grpc.StatusCode.OK, "", json.loads(json_format.MessageToJson(response))
