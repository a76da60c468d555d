"""Lowering: the Dynamo/Inductor backend (`backend`, imported on demand: it pulls in the
passes), ahead-of-time compiles for GPU architectures (`aot`), the graph sections and the
compiled-graph cache. The ops the passes emit, their kernel configs and the runtime state they
read (the serving pool, symmetric-memory buffers) are in metainfer.kernels: lowering depends on
passes and kernels, never the reverse.
"""
