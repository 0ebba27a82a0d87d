"""fnkernel's servers: the Runtime Server (executor.v1 Runtime + FunctionRuntime) and, later,
runtimed, the gateway and the evaluator chain."""

from fnkernel.runtime_server import grpc_engine

grpc_engine.install()  # before any of our modules imports grpc (grpc_engine's docstring)
