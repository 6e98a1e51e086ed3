"""vLLM's gRPC engine service (``vllm_engine.proto``) and its generated modules; the server is
:mod:`hookllm.server.grpc_server`, the client :mod:`hookllm.grpc_client`."""
