"""gRPC options shared by the shard's server and the workers' channels."""
from __future__ import annotations

from imerge.core.codec import CHUNK_BYTES
from imerge.core.limits import MAX_STREAMS_PER_CONNECTION

MAX_MESSAGE_BYTES = 2 * CHUNK_BYTES + 4096  # one chunk of tensor data and its header
SERVICE_NAME = "imerge.v1.ParameterServer"

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # A frozen (SIGSTOP) or partitioned shard stops answering pings: calls on the channel fail with
    # UNAVAILABLE within keepalive time + timeout (about 3 s), not at their deadline.
    ("grpc.keepalive_time_ms", 1_000),
    ("grpc.keepalive_timeout_ms", 2_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # a shard back from a restart or a partition is reconnected to within 2 s
    ("grpc.max_reconnect_backoff_ms", 2_000),
]

SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    # the workers ping every second (they detect a frozen shard by it): allow that
    ("grpc.http2.min_ping_interval_without_data_ms", 500),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),  # more wait in the client's HTTP/2 queue
]
