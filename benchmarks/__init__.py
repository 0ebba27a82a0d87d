"""fnkernel's benchmarks (`make bench`, `make bench-peers`). fnkernel is imported first, as a user's
program would, so that every process here — this one and the bare chains it starts — runs grpc
on the engine fnkernel's own processes run it on (runtime_server.grpc_engine)."""

import fnkernel.runtime_server  # noqa: F401 — before grpc
