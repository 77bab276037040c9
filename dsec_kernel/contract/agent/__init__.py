"""The agent protocol (``agent.proto``): how an edge reaches the inside of a sandbox.

``agent_pb2`` holds its messages (protobuf only); ``agent_pb2_grpc`` its gRPC service stubs,
which load the grpc runtime; :mod:`dsec_kernel.agent` is the edge's client for it.
"""
