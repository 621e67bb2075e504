"""``imerge health``: the container health check.

Asks a shard's gRPC health service (``grpc.health.v1``) whether it is SERVING,
or, for the roles without a gRPC server (coordinator, worker), whether their
/metrics endpoint answers. Exit 0: healthy; 1: not, with the reason.
"""
from __future__ import annotations

import dataclasses
import urllib.error
import urllib.request

from imerge.core.config import TlsConfig, option, require
from imerge.core.errors import IMergeError

SHARD_SERVICE = "imerge.v1.ParameterServer"


@dataclasses.dataclass(frozen=True)
class HealthConfig(TlsConfig):
    address: str = option("127.0.0.1:50051", "host:port of the shard's gRPC server to ask")
    service: str = option(SHARD_SERVICE, "service name to ask the gRPC health service about ('' = the server)")
    http_address: str = option("", "instead, check that http://HOST:PORT/metrics answers (coordinator, worker)")
    timeout_s: float = option(3.0, "timeout of the check")

    def __post_init__(self) -> None:
        TlsConfig.__post_init__(self)
        require(self.timeout_s > 0, "timeout_s", "must be positive")
        require(":" in self.address, "address", "expected host:port")
        require(not self.http_address or ":" in self.http_address, "http_address", "expected host:port")


def check_grpc(config: HealthConfig) -> str:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from imerge.wire.tls import channel_credentials

    address, service, timeout_s = config.address, config.service, config.timeout_s
    channel = (grpc.secure_channel(address, channel_credentials(config)) if config.tls_client
               else grpc.insecure_channel(address))
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=timeout_s)
        except grpc.RpcError as exc:
            raise IMergeError(f"{address}: health check failed: {exc.code().name}: {exc.details()}") from None
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if status != "SERVING":
        raise IMergeError(f"{address}: {service or 'server'} is {status}")
    return f"{address}: {service or 'server'} is SERVING"


def check_http(address: str, timeout_s: float) -> str:
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as reply:
            reply.read(1)
    except (OSError, urllib.error.URLError) as exc:
        raise IMergeError(f"http://{address}/metrics does not answer: {exc}") from None
    return f"http://{address}/metrics answers"


def run_health(config: HealthConfig) -> str:
    if config.http_address:
        return check_http(config.http_address, config.timeout_s)
    return check_grpc(config)
