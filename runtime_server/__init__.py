"""fnkernel's servers: the Runtime Server (executor.v1 Runtime + FunctionRuntime) and, later,
runtimed, the gateway and the evaluator chain."""
